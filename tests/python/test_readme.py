"""The README's Python example, extracted from README.md and run as written (needs torch with a CUDA device)."""

import re
from pathlib import Path

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - CPU machines without torch
    HAS_CUDA = False

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_python_example():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no ```python block"
    return blocks[0]


def test_readme_has_python_example():
    assert "import tessera" in readme_python_example()


@pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")
def test_readme_python_example_runs(capsys):
    exec(compile(readme_python_example(), str(README), "exec"), {})
    out = capsys.readouterr().out
    # The example prints the output shape and the number of routed copies (16 tokens x 8).
    assert "torch.Size([16, 7168])" in out and out.strip().endswith("128"), out
