"""ext.cross_entropy (ext/csrc/loss.cpp) against F.cross_entropy: loss and gradient, float64 for exactness
and float32 for the real path, over many shapes, with ignored rows, extreme values and the fallbacks."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ext
from conftest import num_threads

SHAPES = [(1, 1), (1, 2), (2, 3), (7, 10), (128, 10), (129, 17), (3, 1000), (64, 257)]
# ours within this of torch's float64 result: float64 exactly up to a few roundings, float32 as a float32
# softmax over a row of up to 1000 values allows
TOLERANCE = {torch.float64: dict(rtol=1e-13, atol=1e-15), torch.float32: dict(rtol=2e-5, atol=2e-7)}


def draw(rows, classes, dtype, seed, ignored=0, scale=3.0, ignore_index=-100):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, classes, generator=generator, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[torch.randperm(rows, generator=generator)[:ignored]] = ignore_index
    return logits.requires_grad_(), target


def loss_and_grad(fn, logits, target, upstream=1.0, **kwargs):
    logits = logits.detach().requires_grad_()
    loss = fn(logits, target, **kwargs)
    (grad,) = torch.autograd.grad(loss * upstream, logits)
    return loss.detach(), grad


def assert_matches_torch(logits, target, upstream=1.0, **kwargs):
    """Ours in logits' dtype against torch's in float64 on the same values."""
    loss, grad = loss_and_grad(ext.cross_entropy, logits, target, upstream, **kwargs)
    reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits.double(), target, upstream, **kwargs)
    assert loss.dtype == grad.dtype == logits.dtype
    tolerance = TOLERANCE[logits.dtype]
    torch.testing.assert_close(loss.double(), reference_loss, equal_nan=True, **tolerance)
    torch.testing.assert_close(grad.double(), reference_grad, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows, classes", SHAPES)
def test_loss_and_gradient_match_torch(rows, classes, dtype):
    for seed in range(3):
        assert_matches_torch(*draw(rows, classes, dtype, seed))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ignored_rows_are_left_out_of_the_mean_and_get_no_gradient(dtype):
    logits, target = draw(128, 10, dtype, seed=0, ignored=37)
    assert_matches_torch(logits, target)
    _, grad = loss_and_grad(ext.cross_entropy, logits, target)
    assert (grad[target == -100] == 0).all() and (grad[target != -100] != 0).any()
    logits, target = draw(50, 10, dtype, seed=1)
    assert (target == 3).sum() > 1
    assert_matches_torch(logits, target, ignore_index=3)  # an index that is also a class: its rows left out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_row_ignored_gives_nan_and_zero_gradients_as_torch(dtype):
    logits, target = draw(5, 4, dtype, seed=0, ignored=5)
    loss, grad = loss_and_grad(ext.cross_entropy, logits, target)
    reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits, target)
    assert loss.isnan() and reference_loss.isnan()
    torch.testing.assert_close(grad, reference_grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_upstream_gradient_scales_the_gradient(dtype):
    assert_matches_torch(*draw(33, 10, dtype, seed=2), upstream=-2.5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [1e-6, 80.0, 1e4])
def test_tiny_and_huge_logits_stay_finite_as_in_torch(dtype, scale):
    logits, target = draw(64, 10, dtype, seed=3, scale=scale)
    assert_matches_torch(logits, target)
    assert ext.cross_entropy(logits, target).isfinite()


def test_minus_infinity_logits_and_nan_logits_behave_as_in_torch():
    logits, target = draw(8, 5, torch.float64, seed=4)
    with torch.no_grad():
        logits[0, 1] = -torch.inf  # a class that cannot be: probability 0
        logits[1, :] = -torch.inf  # a row with no possible class: NaN
        logits[2, 3] = torch.nan
    for rows in ([0], [1], [2], [0, 3], [1, 3], [2, 3]):
        loss, grad = loss_and_grad(ext.cross_entropy, logits[rows], target[rows])
        reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits[rows], target[rows])
        torch.testing.assert_close(loss, reference_loss, equal_nan=True, rtol=1e-13, atol=0)
        torch.testing.assert_close(grad, reference_grad, equal_nan=True, rtol=1e-13, atol=1e-16)
    ignored = target.clone()
    ignored[1:3] = -100  # rows of NaN: left out of the loss, but their gradient is NaN in torch's too
    loss, grad = loss_and_grad(ext.cross_entropy, logits, ignored)
    reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits, ignored)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, reference_grad, equal_nan=True, rtol=1e-13, atol=1e-16)
    assert grad[1:3].isnan().all()
    for which in (ext.cross_entropy, F.cross_entropy):  # the same with create_graph, through the double-backward path
        leaf = logits.detach().requires_grad_()
        (grad_with_graph,) = torch.autograd.grad(which(leaf, ignored), leaf, create_graph=True)
        torch.testing.assert_close(grad_with_graph, reference_grad, equal_nan=True, rtol=1e-13, atol=1e-16)
    target[0] = 0 if target[0] == 1 else target[0]
    assert_matches_torch(logits[:1], target[:1])


def test_a_target_that_is_no_class_is_refused_in_one_line():
    logits = torch.randn(4, 10)
    for bad in (10, -1):
        target = torch.tensor([0, 1, bad, 2])
        with pytest.raises(IndexError, match=rf"^ext.cross_entropy: target {bad} \(row 2\) is not a class index: "
                                             r"with 10 classes, targets are 0..9 \(or ignore_index=-100"):
            ext.cross_entropy(logits, target)


def test_an_input_or_target_that_is_no_tensor_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"^ext.cross_entropy: target must be a torch.Tensor, got list$"):
        ext.cross_entropy(torch.randn(3, 4), [0, 1, 2])
    with pytest.raises(TypeError, match=r"^ext.cross_entropy: input must be a torch.Tensor, got float$"):
        ext.cross_entropy(1.0, torch.tensor([0]))


@pytest.mark.parametrize("ignore_index", [1.5, None, 2**70, True])
def test_an_ignore_index_that_is_no_integer_is_refused_in_one_line(ignore_index):
    with pytest.raises(TypeError, match=rf"^ext.cross_entropy: ignore_index must be an integer .*got {ignore_index}$"):
        ext.cross_entropy(torch.randn(4, 10), torch.tensor([1, 2, 3, 4]), ignore_index=ignore_index)


def test_a_target_changed_after_the_forward_is_refused_by_the_backward():
    logits = torch.zeros(4, 5, requires_grad=True)
    for bad in (7, 10**12):  # torch's backward refuses it too; read unchecked, it would index past the rows
        target = torch.tensor([0, 1, 2, 3])
        loss = ext.cross_entropy(logits, target)
        target.data[3] = bad
        with pytest.raises(IndexError, match=rf"^ext.cross_entropy: target {bad} \(row 3\) is not a class index"):
            loss.backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_double_backward_matches_torch(dtype):
    logits, target = draw(16, 7, dtype, seed=5, ignored=3)

    def second_order(fn):
        x = logits.detach().requires_grad_()
        (grad,) = torch.autograd.grad(fn(x, target), x, create_graph=True)
        return torch.autograd.grad((grad * grad.detach().sign()).sum(), x)[0]

    torch.testing.assert_close(second_order(ext.cross_entropy), second_order(F.cross_entropy), **TOLERANCE[dtype])
    target = torch.full_like(target, -100)  # no row counted: a NaN loss, and no second-order gradient
    assert torch.equal(second_order(ext.cross_entropy), second_order(F.cross_entropy))
    assert (second_order(ext.cross_entropy) == 0).all()


def test_without_gradients_the_loss_is_the_same():
    logits, target = draw(128, 10, torch.float32, seed=6, ignored=5)
    with_grad = ext.cross_entropy(logits, target)
    with torch.no_grad():
        no_grad = ext.cross_entropy(logits, target)
    with torch.inference_mode():
        inference = ext.cross_entropy(logits, target)
    assert with_grad.requires_grad and not no_grad.requires_grad
    assert torch.equal(with_grad.detach(), no_grad) and torch.equal(no_grad, inference)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", ["rows padded", "one row broadcast", "overlapping rows", "one class, strided"])
def test_the_kernel_reads_rows_through_their_stride(layout, dtype):
    generator = torch.Generator().manual_seed(12)
    if layout == "rows padded":
        logits = torch.randn(6, 20, generator=generator, dtype=dtype)[:, :10]
    elif layout == "one row broadcast":
        logits = torch.randn(1, 10, generator=generator, dtype=dtype).expand(6, 10)
    elif layout == "overlapping rows":
        logits = torch.randn(40, generator=generator, dtype=dtype).as_strided((6, 10), (3, 1))
    else:
        logits = torch.randn(6, 3, generator=generator, dtype=dtype)[:, 1:2]
    assert logits.stride(1) == 1 or logits.shape[1] == 1
    target = torch.randint(0, logits.shape[1], (6,), generator=generator)
    assert_matches_torch(logits, target)


@pytest.mark.parametrize("case", ["strided columns", "transposed", "bfloat16", "1-D", "3-D", "int32 target"])
def test_what_the_kernel_does_not_take_runs_torchs_cross_entropy(case):
    generator = torch.Generator().manual_seed(7)
    logits, target = torch.randn(6, 10, generator=generator), torch.randint(0, 10, (6,), generator=generator)
    if case == "strided columns":
        logits = torch.randn(6, 20, generator=generator)[:, ::2]
    elif case == "transposed":
        logits = torch.randn(10, 6, generator=generator).t()
    elif case == "bfloat16":
        logits = logits.bfloat16()
    elif case == "1-D":
        logits, target = logits[0], target[0]
    elif case == "3-D":
        logits, target = torch.randn(6, 10, 4, generator=generator), torch.randint(0, 10, (6, 4), generator=generator)
    logits.requires_grad_()
    if case == "int32 target":  # refused with torch's own message
        with pytest.raises(RuntimeError) as theirs:
            F.cross_entropy(logits, target.int())
        with pytest.raises(RuntimeError) as ours:
            ext.cross_entropy(logits, target.int())
        assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]
        return
    loss, grad = loss_and_grad(ext.cross_entropy, logits, target)
    reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits, target)
    assert torch.equal(loss, reference_loss) and torch.equal(grad, reference_grad)


def test_under_cpu_autocast_the_loss_runs_in_float32_as_torchs():
    logits = torch.randn(8, 10).bfloat16().requires_grad_()
    target = torch.randint(0, 10, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad = loss_and_grad(ext.cross_entropy, logits, target)
        reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits, target)
        with torch.profiler.profile() as profile:  # our kernel, on the input cast up
            ext.cross_entropy(logits, target)
    assert loss.dtype == reference_loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, reference_loss)
    torch.testing.assert_close(grad, reference_grad)
    assert not any("log_softmax" in event.name for event in profile.events())
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    fake_logits, fake_target = mode.from_tensor(logits.detach()), mode.from_tensor(target)
    with mode, torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.ops.ext.cross_entropy(fake_logits, fake_target).dtype == torch.float32


def test_torch_func_grad_and_fake_tensors():
    logits, target = draw(9, 4, torch.float64, seed=8)
    ours = torch.func.grad(lambda x: ext.cross_entropy(x, target))(logits.detach())
    torch.testing.assert_close(ours, torch.func.grad(lambda x: F.cross_entropy(x, target))(logits.detach()))
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    fake_logits, fake_target = mode.from_tensor(logits.detach()), mode.from_tensor(target)
    with mode:
        fake = torch.ops.ext.cross_entropy(fake_logits, fake_target)
    assert fake.shape == () and fake.dtype == torch.float64


def test_meta_tensors_give_a_scalar_and_torchs_shape_checks():
    loss = ext.cross_entropy(torch.empty(5, 3, device="meta"), torch.empty(5, dtype=torch.long, device="meta"))
    assert loss.device.type == "meta" and loss.shape == ()
    with torch.inference_mode(), pytest.raises(ValueError, match=r"^Expected input batch_size \(5\) to match"):
        ext.cross_entropy(torch.empty(5, 3, device="meta"), torch.empty(4, dtype=torch.long, device="meta"))


def test_the_backward_is_one_kernel_named_for_the_profiler():
    logits, target = draw(128, 10, torch.float32, seed=9)
    with torch.profiler.profile() as profile:
        ext.cross_entropy(logits, target).backward()
    names = [event.name for event in profile.events()]
    assert "ext::cross_entropy_backward" in names
    assert not any("log_softmax" in name or "nll_loss" in name for name in names)


def test_float32_softmax_is_within_a_few_roundings_of_float64():
    # rows [0, x]: the gradient of the summed loss at class 1 is softmax's exp(x) / (1 + exp(x)), so its error
    # is the kernel's exp's plus two roundings; x over the whole range where exp(x) is a normal float32
    x = torch.linspace(-87, 0, 100_001, dtype=torch.float32)
    logits, target = torch.stack([torch.zeros_like(x), x], 1), torch.zeros(len(x), dtype=torch.long)
    _, grad = loss_and_grad(ext.cross_entropy, logits, target, upstream=len(x))
    exp = x.double().exp()
    relative_error = (grad[:, 1].double() - exp / (1 + exp)).abs() / (exp / (1 + exp))
    assert relative_error.max() < 4 * torch.finfo(torch.float32).eps / 2  # measured: 3.1 half-ulps (torch's 10)
    below = torch.tensor([[0.0, -87.5], [0.0, -100.0], [0.0, -torch.inf]])  # exp under float32's normal range
    _, grad = loss_and_grad(ext.cross_entropy, below, torch.zeros(3, dtype=torch.long), upstream=3)
    assert (grad[:, 1] >= 0).all() and (grad[:, 1] < 1.2e-38).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_large_input_runs_in_blocks_on_all_threads_with_the_same_result_for_any_thread_count(dtype):
    logits, target = draw(3001, 97, dtype, seed=10, ignored=100)  # 291k values: 8 blocks of 337 rows and a rest
    with num_threads(1):
        one_thread = loss_and_grad(ext.cross_entropy, logits, target)
    with num_threads(2):
        two_threads = loss_and_grad(ext.cross_entropy, logits, target)
    assert torch.equal(one_thread[0], two_threads[0]) and torch.equal(one_thread[1], two_threads[1])
    assert_matches_torch(logits, target)
    target[2999], target[2000] = 97, 500  # targets out of range in two blocks: the first is named
    for _ in range(5):
        with num_threads(2), pytest.raises(IndexError, match=r"^ext.cross_entropy: target 500 \(row 2000\)"):
            ext.cross_entropy(logits, target)


def test_an_empty_batch_gives_nan_as_torch():
    logits, target = torch.empty(0, 10, requires_grad=True), torch.empty(0, dtype=torch.long)
    loss, grad = loss_and_grad(ext.cross_entropy, logits, target)
    assert loss.isnan() and F.cross_entropy(logits, target).isnan() and grad.shape == (0, 10)


def test_torch_compile_traces_it_without_graph_breaks():
    # traced through fake tensors, the op records torch's own loss (the kernel needs real CPU tensors)
    logits, target = draw(16, 10, torch.float32, seed=11, ignored=2)
    compiled = torch.compile(lambda x, t: ext.cross_entropy(x, t), fullgraph=True)
    loss, grad = loss_and_grad(compiled, logits, target)
    reference_loss, reference_grad = loss_and_grad(F.cross_entropy, logits, target)
    torch.testing.assert_close(loss, reference_loss)
    torch.testing.assert_close(grad, reference_grad)


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:FutureWarning")  # it still works
def test_torchscript_compiles_a_module_that_calls_it():
    class Loss(torch.nn.Module):
        def forward(self, logits, target):
            return ext.cross_entropy(logits, target)

    class SmoothedLoss(torch.nn.Module):
        def forward(self, logits, target):
            return ext.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")

    logits, target = draw(8, 5, torch.float64, seed=13, ignored=1)
    torch.testing.assert_close(torch.jit.script(Loss())(logits, target), F.cross_entropy(logits, target),
                               rtol=1e-13, atol=0)
    torch.testing.assert_close(torch.jit.script(SmoothedLoss())(logits, target),
                               F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum"),
                               rtol=1e-13, atol=0)


WEIGHT = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0], dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated:UserWarning")
@pytest.mark.parametrize("args, kwargs", [
    ((), dict(weight=WEIGHT)), ((WEIGHT,), {}), ((), dict(weight=WEIGHT, ignore_index=2)),
    ((), dict(reduction="none")), ((), dict(reduction="sum")), ((), dict(label_smoothing=0.1)),
    ((), dict(label_smoothing=0.2, reduction="none", weight=WEIGHT)), ((), dict(size_average=False)),
    ((), dict(reduce=False)),
], ids=lambda value: str(value)[:40])
def test_f_cross_entropys_other_arguments_give_torchs_loss(args, kwargs):
    logits, target = draw(9, 5, torch.float64, seed=21, ignored=2, ignore_index=kwargs.get("ignore_index", -100))
    loss = ext.cross_entropy(logits, target, *args, **kwargs)
    reference = F.cross_entropy(logits, target, *args, **kwargs)
    torch.testing.assert_close(loss, reference, rtol=1e-13, atol=0)
    upstream = torch.randn_like(loss)
    torch.testing.assert_close(torch.autograd.grad(loss, logits, upstream)[0],
                               torch.autograd.grad(reference, logits, upstream)[0], rtol=1e-13, atol=0)


@pytest.mark.parametrize("ignore_index", [np.int64(3), torch.tensor(3), torch.tensor([3])], ids=type)
def test_an_ignore_index_torch_takes_as_an_integer_runs_the_kernel(ignore_index):
    logits, target = draw(128, 10, torch.float64, seed=22, ignored=5, ignore_index=3)
    with torch.profiler.profile() as profile:
        assert_matches_torch(logits, target, ignore_index=ignore_index)
    assert "ext::cross_entropy_backward" in [event.name for event in profile.events()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_gradients_match_torch(dtype):
    logits, target = draw(6, 4, dtype, seed=23, ignored=1)
    upstream = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    ours, theirs = (torch.autograd.grad(fn(logits, target), logits, upstream, is_grads_batched=True)[0]
                    for fn in (ext.cross_entropy, F.cross_entropy))
    torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
    ours, theirs = (torch.autograd.functional.jacobian(lambda x: fn(x, target), logits.detach(), vectorize=True)
                    for fn in (ext.cross_entropy, F.cross_entropy))
    torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
