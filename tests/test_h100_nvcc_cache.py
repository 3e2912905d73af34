"""The h100 cubin cache key covers the module and every header beside it (CPU only, no nvcc);
with nvcc (no GPU needed), a cubin is the same wherever rvcompile is installed."""

from __future__ import annotations

import shutil

import pytest

from rvcompile.targets.h100 import nvcc
from rvcompile.targets.h100.nvcc import KERNEL_DIR, cache_key

VERSION = "Build cuda_13.0.r13.0/compiler.36424714_0"


def _kernel_copy(tmp_path):
    """A copy of the kernel directory, so the test can edit files."""
    return shutil.copytree(KERNEL_DIR, tmp_path / "kernels")


def test_key_is_stable(tmp_path) -> None:
    kernels = _kernel_copy(tmp_path)
    assert cache_key(kernels / "norms.cu", VERSION) == cache_key(kernels / "norms.cu", VERSION)
    assert cache_key(kernels / "norms.cu", VERSION) == cache_key(KERNEL_DIR / "norms.cu", VERSION)


def test_header_edit_changes_key(tmp_path) -> None:
    kernels = _kernel_copy(tmp_path)
    header = kernels / "extra.cuh"
    header.write_text("#pragma once\n")
    before = cache_key(kernels / "norms.cu", VERSION)
    header.write_text("#pragma once\n// edited\n")
    assert cache_key(kernels / "norms.cu", VERSION) != before


def test_new_header_changes_key(tmp_path) -> None:
    kernels = _kernel_copy(tmp_path)
    before = cache_key(kernels / "rows.cu", VERSION)
    (kernels / "extra.cuh").write_text("#pragma once\n")
    assert cache_key(kernels / "rows.cu", VERSION) != before


def test_module_and_version_change_key(tmp_path) -> None:
    kernels = _kernel_copy(tmp_path)
    before = cache_key(kernels / "rows.cu", VERSION)
    assert cache_key(kernels / "rows.cu", VERSION + "x") != before
    (kernels / "rows.cu").write_text((kernels / "rows.cu").read_text() + "\n")
    assert cache_key(kernels / "rows.cu", VERSION) != before


def test_shared_header_edit_changes_every_key(tmp_path) -> None:
    kernels = _kernel_copy(tmp_path)
    modules = sorted(kernels.glob("*.cu"))
    before = {m.name: cache_key(m, VERSION) for m in modules}
    common = kernels / "common.cuh"
    common.write_text(common.read_text() + "\n// edited\n")
    assert all(cache_key(m, VERSION) != before[m.name] for m in modules)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cubins_do_not_depend_on_where_rvcompile_is_installed(tmp_path, monkeypatch) -> None:
    """nvcc names internal symbols after the source's real path (and CUTLASS's asserts keep
    header paths): compiled where they lie, the same sources from two install paths gave two
    cubins. Staged under their key, a copy of the kernels elsewhere compiles to the same bytes."""
    here = nvcc.compile_cubin("sample.cu", tmp_path / "a")
    elsewhere = tmp_path / "site-packages" / "rvcompile" / "kernels"
    shutil.copytree(nvcc.KERNEL_DIR, elsewhere)
    monkeypatch.setattr(nvcc, "KERNEL_DIR", elsewhere)
    assert nvcc.compile_cubin("sample.cu", tmp_path / "b") == here


def test_a_stage_that_cannot_be_made_is_one_line(tmp_path, monkeypatch) -> None:
    """Where the sources cannot be staged (here: under a file), nvcc is not run and the error
    is one line naming the stage."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(nvcc, "STAGE", blocker / "stage")
    with pytest.raises(nvcc.NvccError) as e:
        nvcc._staged(KERNEL_DIR, [KERNEL_DIR / "sample.cu"], "sample-test")
    assert str(e.value).startswith(f"cannot stage the kernel sources in {blocker / 'stage'}: ")
    assert "\n" not in str(e.value)
