"""packsft.extras: a missing optional dependency names the extra that installs it."""

import pytest

from packsft.extras import import_extra


def test_a_missing_module_names_its_extra_and_the_packages():
    with pytest.raises(ValueError, match=r"^--engine ray needs the packsft\[ray\] extra: pip install 'packsft\[ray\]' "
                                         r"\(or pip install ray\[data\]\); import packsft_no_such\.x failed"):
        import_extra("packsft_no_such.x", "ray", "--engine ray", ValueError)
    assert import_extra("json", "datasets", "unused").__name__ == "json"

