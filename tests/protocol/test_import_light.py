"""The protocol package and the client load neither torch nor ray."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["memkv.protocol", "memkv.protocol.wire", "memkv.client"])
def test_imports_neither_torch_nor_ray(module):
    code = f"import sys, {module}; print(sorted({{'torch', 'ray'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["memkv.router", "memkv.router.service", "memkv.archive"])
def test_the_router_wing_loads_no_torch(module):
    """The router process (and the archive's) never needs tensors: a shard starts fast
    and small. Holder once pulled the block pool, and torch with it, into the router."""
    code = f"import sys, {module}; print(sorted({{'torch'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
