"""The `ext` fixture of the GGUF kernel tests (tests/ops/test_quant_*.py), a plugin of conftest.py."""
import pytest

from specengine.models import quant_linear


@pytest.fixture(params=quant_linear._quantext.isas() if quant_linear._quantext else [])
def ext(request):
    """The compiled kernel, once per instruction-set copy this CPU runs (the widest restored after)."""
    ext = quant_linear._quantext
    widest = ext.isa()
    ext.set_isa(request.param)
    yield ext
    ext.set_isa(widest)
