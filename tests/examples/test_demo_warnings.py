"""examples/demo.sh hides only the named third-party warnings; packsft's own (and any other) still show."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import warnings
from packsft.data.dataset import PackedDataWarning
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
warnings.warn("`load_state_dict` is deprecated and will be removed in future versions.", FutureWarning)
warnings.warn("row 3 right-truncated to max_seq_len", PackedDataWarning)
warnings.warn("some other library's warning", UserWarning)
"""


def demo_python_warnings() -> str:
    script = REPO / "examples" / "demo.sh"
    block = 'eval "$(sed -n "/^THIRD_PARTY_WARNINGS=(/,/^export PYTHONWARNINGS/p" "$1")"; printf %s "$PYTHONWARNINGS"'
    return subprocess.run(["bash", "-c", block, "bash", str(script)], capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin"}).stdout


def test_demo_filters_only_named_third_party_warnings():
    filters = demo_python_warnings()
    assert filters and all(f.startswith("ignore:") and f.count(":") >= 2 for f in filters.split(","))
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONWARNINGS": filters, "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert "not installed" not in proc.stderr and "load_state_dict" not in proc.stderr
    assert "PackedDataWarning: row 3 right-truncated" in proc.stderr
    assert "UserWarning: some other library's warning" in proc.stderr
