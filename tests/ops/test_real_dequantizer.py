"""Our torch reference dequantizer (kernels/quant_matmul.py) against the `gguf` package's on every
quantized tensor of the real GGUF files. A file of its own outside tests/real/: it reads the files a
tensor at a time (well under 1 GiB), so the slow tier's scheduler runs it on the light worker beside
the real-model files (tests/helpers/scheduling.py), not after them."""
import pytest
import torch

from specengine.models.fetch import cache_dir, fetch

pytestmark = [pytest.mark.real, pytest.mark.slow]
REAL_FILES = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]


@pytest.mark.parametrize("name", REAL_FILES)
def test_every_tensor_dequantizes_as_the_gguf_package_does(name):
    """Our torch reference against `gguf`'s dequantizer on every quantized tensor of the file
    (its first and last 1,024 rows: a block decodes alike at every row, and `gguf`'s numpy
    dequantizer took a minute over both real files' every row in CI)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from specengine.kernels.quant_matmul import FORMATS, dequantize_ref

    fetch(name)
    reader = GGUFReader(cache_dir() / "gguf" / f"{name}.gguf")
    checked = 0
    for t in reader.tensors:
        if t.tensor_type.name not in FORMATS:
            continue
        data = np.asarray(t.data)
        for lo in sorted({0, max(0, data.shape[0] - 1024)}):
            chunk = data[lo:lo + 1024]
            theirs = torch.from_numpy(dequantize(chunk, t.tensor_type).reshape(chunk.shape[0], -1))
            ours = dequantize_ref(torch.from_numpy(chunk.copy()), t.tensor_type.name)
            assert torch.equal(ours, theirs), (t.name, t.tensor_type.name)
        checked += 1
    assert checked >= 24, checked  # every layer's projections at least
