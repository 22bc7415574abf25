from __future__ import annotations

import asyncio

import pytest

import tierkv.runtime as runtime
from tierkv.runtime import BackendUnavailableError, CpuBackend, create_backend, new_event_loop, run
from tierkv.runtime.cuda_backend import CudaBackend, cuda_available
from tierkv.runtime.loop import has_uvloop


def test_registry() -> None:
    assert isinstance(create_backend("cpu"), CpuBackend)
    assert create_backend("auto").name == ("cuda" if cuda_available() else "cpu")
    assert "cpu" in runtime.available_backends()
    with pytest.raises(BackendUnavailableError):
        create_backend("tpu")


@pytest.mark.skipif(cuda_available(), reason="CUDA is present")
def test_cuda_backend_explains_why_it_is_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match=r"CuPy|CUDA"):
        create_backend("cuda")
    with pytest.raises(BackendUnavailableError):
        CudaBackend()


def test_runtime_does_not_import_tierkv() -> None:
    """runtime imports only itself and transports (the core above it never)."""
    import ast
    import pathlib

    root = pathlib.Path(runtime.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name == "tierkv" or name.startswith("tierkv."):
                    assert name.startswith(("tierkv.runtime", "tierkv.transports")), (path, name)


@pytest.mark.parametrize("use_uvloop", [False, True])
def test_loop_helpers(use_uvloop: bool) -> None:
    if use_uvloop and not has_uvloop():
        pytest.skip("uvloop not installed")

    async def main() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    module = run(main(), use_uvloop=use_uvloop)
    assert module.startswith("uvloop") == use_uvloop
    loop = new_event_loop(use_uvloop=use_uvloop)
    loop.close()
