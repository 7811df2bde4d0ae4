"""The protocol package and the client load neither torch nor ray."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["memkv.protocol", "memkv.protocol.wire", "memkv.client"])
def test_imports_neither_torch_nor_ray(module):
    code = f"import sys, {module}; print(sorted({{'torch', 'ray'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
