"""packsft.train.energon_state: Energon's loader state as plain values, rebuilt into Energon's own classes only."""

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.energon")

from megatron.energon.state import FlexState  # noqa: E402

from packsft.train.energon_state import from_plain, plain_state  # noqa: E402


def test_plain_state_round_trips_energon_values():
    value = FlexState(rng=b"\x00\xff", arr=np.arange(3, dtype=np.uint32), t=(1, "a", [2.5, None]),
                      tensor=torch.arange(2))
    back = from_plain(plain_state(value))
    assert type(back) is FlexState and back["rng"] == b"\x00\xff" and back["t"] == (1, "a", [2.5, None])
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [0, 1, 2] and torch.equal(back["tensor"],
                                                                                                 torch.arange(2))
    for planted in ("os:path", "megatron.energon.watchdog:os", "megatron.energon.watchdog:threading",
                    "megatron.energon.errors:reraise_exception"):       # only energon's own state classes
        with pytest.raises(ValueError, match="not one of megatron.energon's"):
            from_plain({"__dataclass__": planted, "fields": {}})
