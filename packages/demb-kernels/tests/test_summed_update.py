"""demb::summed_update, the table module's C++ autograd node: identity forward, and a backward
that sums each unique key's gradient rows and updates the tables in place. Checked with SGD
against the closed form in float64 (rows -= lr * the summed gradient), on the CPU and (marker
``cuda``) on a GPU; NaN/inf sums, bad arguments, in-place use of the output."""

from __future__ import annotations

import pytest
import torch
from demb_kernels.lookup import segment_plan

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LR = 0.25
SGD = [LR] + [0.0] * 8  # optimizer_update's nine floats for SGD


def case(device, gen, n=40, unique=9, sizes=(4, 5), dim=3, rows=12):
    """A batch of ``n`` entries over ``unique`` keys (two tables), its order and starts; keys
    2, 5, 8... have one entry (their sums are skipped: the update reads their rows)."""
    several = torch.tensor([u for u in range(unique) if u % 3 != 2])
    extra = several[torch.randint(0, several.numel(), (n - unique,), generator=gen)]
    inverse = torch.cat([torch.arange(unique), extra])
    inverse = inverse[torch.randperm(n, generator=gen)]
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=unique)
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.cat([torch.randperm(rows, generator=gen)[:s] for s in sizes])
    slots[1] = -1  # a key without a slot: skipped
    values = [torch.randn(rows, dim, generator=gen) for _ in sizes]
    return {
        "inverse": inverse.to(device),
        "order": order.to(device),
        "starts": starts.to(device),
        "slots": slots.to(device),
        "values": [v.to(device) for v in values],
        "sizes": list(sizes),
        "dim": dim,
    }


def wire(
    c, out, *, rows=None, scale=None, clip=None, check=True, steps=None, hyper=SGD, plan=True,
    workspace=None, nonfinite=None,
):  # fmt: skip
    trigger = torch.zeros((), device=out.device, requires_grad=True)
    steps = torch.zeros(len(c["sizes"]), dtype=torch.int64) if steps is None else steps
    plan = segment_plan(c["starts"], c["order"].numel()) if out.is_cuda and plan else None
    wired = torch.ops.demb.summed_update(
        trigger, out, c["order"], c["starts"], plan, rows, scale, c["slots"], c["sizes"],
        c["values"], [c["dim"]] * len(c["sizes"]), steps, "sgd", hyper, clip, check, c["dim"],
        workspace, nonfinite,
    )  # fmt: skip
    return wired, steps


def expected_rows(c, before, per_entry):
    """Closed form in float64: each slot's row minus LR times its key's summed entries."""
    inverse = c["inverse"].cpu()
    sums = torch.zeros(len(c["slots"]), c["dim"], dtype=torch.float64)
    sums.index_add_(0, inverse, per_entry.double().cpu())
    out = [v.double().cpu().clone() for v in before]
    bounds = [0, c["sizes"][0], sum(c["sizes"])]
    for t in range(len(c["sizes"])):
        for u in range(bounds[t], bounds[t + 1]):
            slot = int(c["slots"][u])
            if slot >= 0:
                out[t][slot] -= LR * sums[u]
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_backward_sums_each_key_and_updates_its_row(device):
    gen = torch.Generator().manual_seed(1)
    c = case(device, gen)
    out = torch.randn(40, c["dim"], generator=gen).to(device)
    before = [v.clone() for v in c["values"]]
    wired, steps = wire(c, out)
    assert wired is out  # the tensor itself, wired: not a view
    assert wired.grad_fn is not None
    grad = torch.randn(40, c["dim"], generator=gen).to(device)
    wired.backward(grad)
    want = expected_rows(c, before, grad)
    for got, w in zip(c["values"], want, strict=True):
        torch.testing.assert_close(got.double().cpu(), w, rtol=1e-5, atol=1e-5)
    assert steps.tolist() == [1, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_pooled_entries_read_their_bag_times_their_factor(device):
    gen = torch.Generator().manual_seed(2)
    c = case(device, gen)
    bags = 7
    rows = torch.randint(0, bags, (40,), generator=gen)
    scale = torch.rand(40, generator=gen)
    out = torch.randn(bags, c["dim"], generator=gen).to(device)
    before = [v.clone() for v in c["values"]]
    wired, _ = wire(c, out, rows=rows.to(device), scale=scale.to(device))
    grad = torch.randn(bags, c["dim"], generator=gen)
    wired.backward(grad.to(device))
    want = expected_rows(c, before, grad[rows] * scale[:, None])
    for got, w in zip(c["values"], want, strict=True):
        torch.testing.assert_close(got.double().cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_clip_clamps_each_entry_before_the_sum(device):
    gen = torch.Generator().manual_seed(3)
    c = case(device, gen)
    out = torch.zeros(40, c["dim"], device=device)
    before = [v.clone() for v in c["values"]]
    wired, _ = wire(c, out, clip=0.5)
    grad = 3 * torch.randn(40, c["dim"], generator=gen)
    wired.backward(grad.to(device))
    want = expected_rows(c, before, grad.clamp(-0.5, 0.5))
    for got, w in zip(c["values"], want, strict=True):
        torch.testing.assert_close(got.double().cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("key", [2, 3], ids=["one-entry-key", "key-of-several"])
@pytest.mark.parametrize("workspace", [False, True], ids=["", "cpu-workspace"])
@pytest.mark.parametrize(
    ("n", "dim"), [(40, 3), (40, 8), (300, 3), (300, 8)],
    ids=["short-scalar", "short-float4", "long-scalar", "long-float4"],
)  # fmt: skip
def test_a_nonfinite_gradient_raises_and_changes_nothing(device, bad, key, workspace, n, dim):
    """On CUDA the first backward takes the direct path (the sums store the flag into the
    thread's pinned scratch), by the plan's chunks (3 floats) or by windows (8): with 300
    entries a key of several has more than one chunk, so its NaN/inf is found by the finish
    pass. The next checked backward, of finite gradients, reuses that scratch: its byte is
    zeroed again, so the step goes through."""
    if workspace and device != "cpu":
        pytest.skip("the workspace is the CPU backward's")
    gen = torch.Generator().manual_seed(4)
    c = case(device, gen, n=n, dim=dim)
    starts = c["starts"].tolist()
    assert (starts[4] - starts[3] > 32) == (n == 300)  # key 3: several chunks in the long case
    out = torch.zeros(n, c["dim"], device=device)
    before = [v.clone() for v in c["values"]]
    wired, steps = wire(c, out, workspace=torch.empty(0) if workspace else None)
    grad = torch.ones(n, c["dim"], device=device)
    grad[int(c["order"][c["starts"][key]]), 1] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        wired.backward(grad)
    for got, b in zip(c["values"], before, strict=True):
        assert torch.equal(got, b)
    assert steps.tolist() == [0, 0]
    wired, steps = wire(c, out, steps=steps)  # checked again, finite: it goes through
    wired.backward(torch.ones(n, c["dim"], device=device))
    assert steps.tolist() == [1, 1]
    wired, steps = wire(c, out, check=False, steps=steps)  # unchecked: updated as given
    wired.backward(grad)
    assert steps.tolist() == [2, 2]
    assert not all(torch.equal(g, b) for g, b in zip(c["values"], before, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [3, 8], ids=["plan", "windows"])
def test_a_given_flag_is_the_one_the_sums_set(dim):
    """``nonfinite`` given (a zeroed byte, as dedup_launch makes one): the direct CUDA backward
    uses it as the sums' NaN/inf flag (set after a rejected step; no flag of its own); one of
    another dtype, size or device is named."""
    gen = torch.Generator().manual_seed(6)
    c = case("cuda", gen, n=300, dim=dim)
    out = torch.zeros(300, c["dim"], device="cuda")
    before = [v.clone() for v in c["values"]]
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    wired, steps = wire(c, out, nonfinite=flag)
    grad = torch.ones(300, c["dim"], device="cuda")
    grad[int(c["order"][c["starts"][3]]), 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        wired.backward(grad)
    assert bool(flag)
    for got, b in zip(c["values"], before, strict=True):
        assert torch.equal(got, b)
    assert steps.tolist() == [0, 0]
    clean = torch.zeros((), dtype=torch.bool, device="cuda")
    wired, steps = wire(c, out, nonfinite=clean, steps=steps)
    wired.backward(torch.ones(300, c["dim"], device="cuda"))
    assert not bool(clean)
    assert steps.tolist() == [1, 1]
    for bad in (
        torch.zeros((), dtype=torch.int64, device="cuda"),
        torch.zeros(2, dtype=torch.bool, device="cuda"),
        torch.zeros((), dtype=torch.bool),
    ):
        with pytest.raises(ValueError, match="nonfinite: expected a zeroed one-element bool"):
            wire(c, out, nonfinite=bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_an_update_that_fails_raises_changes_nothing_and_the_next_step_works(device, check):
    """The update's own checks fail after the sums were queued (a value buffer narrowed
    between the forward and the backward; on CUDA with the check, after the sums may store
    into the thread's pinned scratch: the backward waits for them before it lets the scratch
    go):
    its error comes out, no row changes, the step counts stay; the buffer restored, the next
    backward updates the rows as the closed form says."""
    gen = torch.Generator().manual_seed(8)
    c = case(device, gen)
    before = [v.clone() for v in c["values"]]
    grad = torch.randn(40, c["dim"], generator=gen).to(device)
    wired, steps = wire(c, torch.zeros(40, c["dim"], device=device), check=check)
    rows = c["values"][0].shape[0]
    c["values"][0].resize_(rows, c["dim"] - 1)  # the same storage, rows one float short
    with pytest.raises(ValueError, match=r"values\[0\] rows have"):
        wired.backward(grad)
    c["values"][0].resize_(rows, c["dim"])
    for got, b in zip(c["values"], before, strict=True):
        assert torch.equal(got, b)
    assert steps.tolist() == [0, 0]
    wired, steps = wire(c, torch.zeros(40, c["dim"], device=device), check=check, steps=steps)
    wired.backward(grad)
    assert steps.tolist() == [1, 1]
    want = expected_rows(c, before, grad)
    for got, w in zip(c["values"], want, strict=True):
        torch.testing.assert_close(got.double().cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooled", [False, True], ids=["rows", "pooled"])
def test_a_cpu_workspace_gives_the_same_rows_and_keeps_its_storage(pooled):
    """The CPU backward's sums into a kept workspace: the same tables, bit for bit, as the op's
    fresh sums, over two backwards (the second of fewer keys, into the same storage), although
    the workspace starts full of NaN (stale rows of one-entry keys are never read)."""
    gen = torch.Generator().manual_seed(7)
    workspace = torch.full((64, 3), float("nan"))
    first = workspace.data_ptr()
    for n, unique in ((40, 9), (25, 6)):
        c = case("cpu", gen, n=n, unique=unique, sizes=(unique - 4, 4))
        twin = {**c, "values": [v.clone() for v in c["values"]]}
        bags = 7 if pooled else n
        rows = torch.randint(0, bags, (n,), generator=gen) if pooled else None
        scale = torch.rand(n, generator=gen) if pooled else None
        grad = torch.randn(bags, c["dim"], generator=gen)
        kept, _ = wire(c, torch.zeros(bags, c["dim"]), rows=rows, scale=scale, workspace=workspace)
        fresh, _ = wire(twin, torch.zeros(bags, c["dim"]), rows=rows, scale=scale)
        kept.backward(grad)
        fresh.backward(grad)
        for got, want in zip(c["values"], twin["values"], strict=True):
            assert torch.equal(got, want)
        assert workspace.data_ptr() == first  # resized in place: no fresh pages
        assert workspace.shape == (unique, c["dim"])


DISPATCHED = ("demb::segment_sum_rows", "demb::segment_single_rows")


def sum_ops_run(wired, grad, retain_graph=False):
    """How many of the ops the direct path launches without (:data:`DISPATCHED`) the backward
    of ``wired`` called (profiled)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wired.backward(grad, retain_graph=retain_graph)
        torch.cuda.synchronize()
    return sum(e.name in DISPATCHED for e in prof.events())


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [3, 8], ids=["scalar", "float4"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_backward_launching_its_sums_equals_the_op_and_runs_once(dim, clip):
    """A CUDA backward launches the sums and the one-entry rows itself, with a plan or without
    one, not through segment_sum_rows and segment_single_rows (whose checks and flag its
    forward did): the same rows, bit for bit, as the ops' path (an order that is not
    contiguous takes it); a second backward of the graph (its flag used) takes the ops' path."""
    gen = torch.Generator().manual_seed(7)
    direct, through = case("cuda", gen, dim=dim), case("cuda", gen, dim=dim)
    planless = {**direct, "values": [v.clone() for v in direct["values"]]}
    through["values"] = [v.clone() for v in direct["values"]]
    for key in ("starts", "slots", "inverse"):
        through[key] = direct[key]
    through["order"] = torch.stack([direct["order"], direct["order"]], 1)[:, 0]
    assert not through["order"].is_contiguous()
    out = torch.zeros(40, dim, device="cuda")
    grads = [torch.randn(40, dim, generator=gen).cuda() for _ in range(2)]
    wired, steps = wire(direct, out, clip=clip)
    bare, bare_steps = wire(planless, out.clone(), clip=clip, plan=False)
    twin, twin_steps = wire(through, out.clone(), clip=clip, plan=False)
    assert sum_ops_run(wired, grads[0], retain_graph=True) == 0
    assert sum_ops_run(bare, grads[0], retain_graph=True) == 0
    assert sum_ops_run(twin, grads[0], retain_graph=True) == 2
    for a, b, c in zip(direct["values"], planless["values"], through["values"], strict=True):
        assert torch.equal(a, c)
        assert torch.equal(b, c)
    assert sum_ops_run(wired, grads[1]) == 2  # the flag is spent: the ops' path, same result
    assert sum_ops_run(bare, grads[1]) == 2
    assert sum_ops_run(twin, grads[1]) == 2
    for a, b, c in zip(direct["values"], planless["values"], through["values"], strict=True):
        assert torch.equal(a, c)
        assert torch.equal(b, c)
    assert steps.tolist() == bare_steps.tolist() == twin_steps.tolist() == [2, 2]


def test_the_output_may_be_changed_in_place_before_backward():
    gen = torch.Generator().manual_seed(5)
    c = case("cpu", gen)
    before = [v.clone() for v in c["values"]]
    wired, _ = wire(c, torch.zeros(40, c["dim"]))
    wired.mul_(2)  # allowed: the backward reads only the incoming gradient
    (wired * 3).sum().backward()
    want = expected_rows(c, before, torch.full((40, c["dim"]), 6.0))
    for got, w in zip(c["values"], want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"steps": torch.zeros(2, dtype=torch.int32)}, "steps"),
        ({"steps": torch.zeros(3, dtype=torch.int64)}, "steps"),
        ({"sizes": [4, 4]}, "table_sizes"),
        ({"hyper": [LR]}, "hyper_parameters"),
        ({"slots": torch.zeros(8, dtype=torch.int64)}, "slots"),
        ({"dim": 5}, "dim"),
        ({"workspace": torch.empty(0, dtype=torch.float64)}, "workspace"),
        ({"workspace": torch.empty(0, requires_grad=True)}, "workspace"),
    ],
)
def test_bad_arguments_raise_naming_them(change, match):
    gen = torch.Generator().manual_seed(6)
    c = case("cpu", gen)
    hyper = change.pop("hyper", SGD)
    steps = change.pop("steps", None)
    workspace = change.pop("workspace", None)
    c.update(change)
    with pytest.raises(ValueError, match=match):
        wire(c, torch.zeros(40, 3), steps=steps, hyper=hyper, workspace=workspace)
