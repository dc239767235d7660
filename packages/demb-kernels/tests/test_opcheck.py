"""``torch.library.opcheck`` of every op of the ``demb`` torch library.

Each op registered in the library has cases here (:func:`test_every_op_has_a_case` fails for a
new op without one), small realistic inputs built as the wrappers build them. A case runs
opcheck's default test utils: ``test_schema`` (the schema declares every argument the kernel
writes, ``(a!)``, and the aliases it returns), ``test_autograd_registration``,
``test_faketensor`` (the fake kernel's shapes, dtypes and devices are the real kernel's) and
``test_aot_dispatch_dynamic`` (traced with dynamic shapes under functionalization, the op gives
eager's results); a case that leaves one out says why beside it. The cases run on the CPU and
(marker ``cuda``) on a GPU; the two CUDA-only ops run their fakes on a CPU machine.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _opcheck_cases import CASES, _summed_update
from _opcheck_inputs import Case, _gen
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv


def registered_ops() -> set[str]:
    return {
        s.name.removeprefix("demb::")
        for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("demb::")
    }


# --- inputs --------------------------------------------------------------------------------


def _params():
    for case in CASES:
        for device in case.devices:
            marks = [pytest.mark.cuda] if device == "cuda" else []
            yield pytest.param(case, device, id=f"{case.op}-{case.name}-{device}", marks=marks)


def test_every_op_has_a_case():
    import demb_kernels

    ops = registered_ops()
    assert set(demb_kernels.OPS) <= ops
    assert {c.op for c in CASES} == ops, "an op without an opcheck case (or a case of no op)"
    cpu = {c.op for c in CASES if "cpu" in c.devices}
    assert ops - cpu == {"dedup_launch", "table_find_or_insert_gated"}
    cuda = {c.op for c in CASES if "cuda" in c.devices}
    assert ops - cuda == {
        "pool_cpu_build",
        "set_thread_intra_op_threads",
        "batch_bounds",
        "gather_rows_many",
        "scatter_rows_many",
        "table_export_scan",
        "slot_writes_check",
        "slot_writes_apply",
    }


@pytest.mark.parametrize(("case", "device"), list(_params()))
def test_opcheck(case: Case, device: str):
    args, kwargs = case.make(torch.device(device))
    rtol, atol = case.tolerance or (None, None)
    op = getattr(torch.ops.demb, case.op).default
    utils = case.cuda_utils if device == "cuda" and case.cuda_utils else case.utils
    torch.library.opcheck(op, args, kwargs, test_utils=utils, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "case", [c for c in CASES if "cpu" not in c.devices], ids=lambda c: f"{c.op}-{c.name}"
)
def test_cuda_only_ops_run_their_fakes_without_a_gpu(case: Case):
    """The ops with a CUDA kernel only: where no GPU runs them, their fake kernels (checked
    against the kernels by test_opcheck on a GPU) still run on fake tensors of these shapes."""
    args, kwargs = case.make(torch.device("cpu"))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, mode.from_tensor, (args, kwargs)
        )
        out = getattr(torch.ops.demb, case.op).default(*fake_args, **fake_kwargs)
    assert all(isinstance(t, torch.Tensor) for t in out)


def test_import_registers_every_fake_kernel():
    """``import demb_kernels`` alone registers a fake (meta) kernel for each op, except
    pool_cpu_build and set_thread_intra_op_threads (no tensors: one kernel for every
    backend) and summed_update (an autograd node whose one kernel also runs on fake
    tensors)."""
    code = (
        "import torch, demb_kernels\n"
        "ops = {s.name[6:] for s in torch._C._jit_get_all_schemas()"
        " if s.name.startswith('demb::')}\n"
        "print(sorted(op for op in ops if not demb_kernels.has_kernel(op, 'Meta')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    want = "['pool_cpu_build', 'set_thread_intra_op_threads', 'summed_update']"
    assert out.stdout.strip() == want


def _tensors(arg: object) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, list | tuple):
        return [t for t in arg if isinstance(t, torch.Tensor)]
    return []


def test_summed_update_declares_what_its_backward_writes():
    """summed_update writes its arguments in its backward, where opcheck's schema util does
    not look: every argument a forward and backward change is declared written, ``(a!)``."""
    args, _ = _summed_update(pooled=True)(torch.device("cpu"))
    before = [[t.clone() for t in _tensors(a)] for a in args]
    out = torch.ops.demb.summed_update.default(*args)
    out.backward(torch.randn(out.shape, generator=_gen(12)))
    schema = torch.ops.demb.summed_update.default._schema
    changed = set()
    for arg, value, old in zip(schema.arguments, args, before, strict=True):
        now = _tensors(value)
        if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(now, old, strict=True)):
            changed.add(arg.name)
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert changed == {"values", "steps", "workspace"}
    assert changed <= written
    assert written == changed | {"nonfinite"}  # the sums' flag, written on CUDA only
