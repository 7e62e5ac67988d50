"""Tests of the training step (fastdata/engine/step.py): dtype and label checks, soft labels, accumulation,
clipping, EMA, gradient checkpointing."""
import contextlib
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import require
from engine_helpers import Crash, ListLoader, Recording, Wrapper, _batches, _params, _plain_net
from fastdata import make_loader
from fastdata.datasets import SyntheticDigits
from fastdata.engine import (
    EpochMeter,
    FitConfig,
    TrainStep,
    default_optimizer,
    evaluate,
    fit,
    train_one_epoch,
    wants_fused,
)
from fastdata.models import SmallCNN


def test_a_bf16_loader_with_amp_off_is_refused_before_training():
    """Decision: refuse, not cast (casting would throw away what a bf16 loader saves)."""
    src = SyntheticDigits(128, seed=2)
    loader = make_loader(src, "torch", batch_size=64, num_workers=0, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"train_loader yields bfloat16 images.*float32 and amp is off: "
                                        r"pass amp='bf16'.*dtype=torch.float32"):
        fit(SmallCNN(width=4), loader, epochs=1, amp="off", progress=False)
    # An object with the loader contract but no config: refused at its first batch, before any step.
    model = SmallCNN(width=4)
    before = _params(model)
    with pytest.raises(TypeError, match="bfloat16"):
        fit(model, ListLoader(_batches(2, dtype=torch.bfloat16)), epochs=1, amp="off", progress=False)
    assert torch.equal(_params(model), before)
    # With autocast the same loader trains.
    hist = fit(SmallCNN(width=4), loader, epochs=1, amp="bf16", progress=False)
    assert math.isfinite(hist[0]["train_loss"])


def test_default_optimizer_is_fused_on_cuda_only():
    """Fused AdamW takes GradScaler's inf check as a device tensor; the non-fused one makes the scaler
    call .item() every fp16 step. torch refuses fused=True for non-floating or non-supported params."""
    def param(device, floating=True):
        return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)

    assert wants_fused([param("cuda:0"), param("cuda:0")], torch.device("cuda", 0))
    assert not wants_fused([param("cuda:0"), param("cuda:0", floating=False)], "cuda:0")
    assert not wants_fused([param("cuda:0"), param("cpu")], "cuda:0")
    assert not wants_fused([param("cpu")], "cpu")
    opt = default_optimizer(SmallCNN(width=4).parameters(), "cpu")
    assert isinstance(opt, torch.optim.AdamW) and not opt.param_groups[0]["fused"]
    assert (opt.defaults["lr"], opt.defaults["weight_decay"]) == (1e-3, 0.01)


class SyncFreeSteps(Wrapper):
    """Passes a loader through and runs fit's steps, from the second on (the first one initializes
    cuDNN's algorithm choice and the optimizer state), under set_sync_debug_mode('error'): any
    synchronizing call inside a step raises. The mode is off while the wrapped loader works and after
    the last batch, so fit's end-of-epoch reads are not counted."""

    def __init__(self, loader):
        self.loader, self.device, self.steps = loader, loader.device, 0

    def __iter__(self):
        it = iter(self.loader)
        try:
            while True:
                torch.cuda.set_sync_debug_mode(0)
                try:
                    batch = next(it)
                except StopIteration:
                    return
                torch.cuda.set_sync_debug_mode("error" if self.steps >= 1 else 0)
                self.steps += 1
                yield batch
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])   # fp16: the default optimizer is fused, so no .item()
def test_fit_steps_do_not_synchronize(amp):
    loader = SyncFreeSteps(ListLoader(_batches(6, size=64, device="cuda"), device="cuda"))
    hist = fit(SmallCNN(width=8), loader, epochs=1, amp=amp, progress=False)
    assert loader.steps == 6 and math.isfinite(hist[0]["train_loss"])


def test_a_model_that_cannot_take_an_empty_batch_under_ddp_gets_a_clear_error():
    """Under DDP an empty rank still runs a (zero-loss) step through the model; a model whose forward
    fails on N=0 must be told why it met an empty batch and what to do."""
    class ViewFlatten(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc(x.view(x.shape[0], -1))   # -1 is ambiguous with 0 rows

    model = ViewFlatten()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                 torch.device("cpu"), "off", ddp=True)
    sums = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"this rank's batch is empty.*x.flatten\(1\).*drop_last=True"):
        step(torch.zeros(0, 1, 16, 16), torch.zeros(0, dtype=torch.long), sums)
    step(torch.zeros(4, 1, 16, 16), torch.zeros(4, dtype=torch.long), sums)   # a real batch trains
    assert sums[2].item() == 4


def _soft(batches, classes=10, seed=0):
    """``batches`` with soft labels: a random probability vector over ``classes`` per sample, as MixUp and
    CutMix make them (float32 (N, classes))."""
    g = torch.Generator().manual_seed(seed)
    return [(x, torch.softmax(3 * torch.randn(x.shape[0], classes, generator=g), 1).to(x.device)) for x, _ in batches]


class LogitsLog(nn.Module):
    """SmallCNN that keeps a copy of every output it returns."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN(width=4)
        self.outputs = []

    def forward(self, x):
        out = self.net(x)
        self.outputs.append(out.detach().clone())
        return out


def _soft_ce(logits, targets):
    """Cross-entropy against class probabilities, summed over the batch, written out by hand."""
    return -(targets * torch.log_softmax(logits.double(), 1)).sum().item()


def test_fit_trains_on_soft_labels_and_counts_argmax_agreement():
    batches = _soft(_batches(3))
    torch.manual_seed(0)
    model = LogitsLog()
    before = _params(model)
    hist = fit(model, ListLoader(batches), epochs=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               progress=False)
    assert not torch.equal(_params(model), before)       # the soft targets trained the model
    assert len(model.outputs) == 6
    agreements = []
    for epoch, record in enumerate(hist):
        outputs = model.outputs[3 * epoch: 3 * epoch + 3]
        agree = sum((o.argmax(1) == y.argmax(1)).sum().item() for o, (_, y) in zip(outputs, batches))
        agreements.append(agree)
        assert record["train_accuracy"] == agree / 48
        assert record["train_loss"] == pytest.approx(sum(_soft_ce(o, y) for o, (_, y) in zip(outputs, batches)) / 48,
                                                     rel=1e-5)
    # The comparison above would pass vacuously at 0 (what comparing argmax with probabilities gives).
    assert sum(agreements) > 0, agreements


class Prior(nn.Module):
    """Logits that are a parameter: ``log p`` for every sample, in ``dtype``."""

    def __init__(self, p, dtype=torch.float32):
        super().__init__()
        self.logits = nn.Parameter(torch.tensor(p).log())
        self.dtype = dtype

    def forward(self, x):
        return self.logits.expand(x.shape[0], -1).to(self.dtype)


P = [0.5, 0.25, 0.25]


SOFT = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.2, 0.6]])


# -(0.7 ln .5 + 0.3 ln .25) and -(0.2 ln .5 + 0.8 ln .25), averaged over the two samples.
SOFT_LOSS = (-(0.7 * math.log(0.5) + 0.3 * math.log(0.25)) - (0.2 * math.log(0.5) + 0.8 * math.log(0.25))) / 2


@pytest.mark.parametrize("dtype, amp, rel", [(torch.float32, "off", 1e-6), (torch.bfloat16, "bf16", 1e-2),
                                             (torch.float16, "fp16", 1e-3)])
def test_soft_label_loss_accuracy_and_gradient_by_hand(dtype, amp, rel):
    """Logits log p against targets t: loss -sum(t log p), right when argmax p == argmax t (the first
    sample, not the second), and one SGD step at lr 1 moves the logits by -(p - mean t). bf16 and fp16
    logits under CPU autocast with float32 targets give the same figures (cross-entropy runs in float32)."""
    images = torch.zeros(2, 1, 4, 4)
    model = Prior(P, dtype)
    result = evaluate(model, ListLoader([(images, SOFT)]), amp=amp)
    assert result["loss"] == pytest.approx(SOFT_LOSS, rel=rel) and result["accuracy"] == 0.5

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = TrainStep(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), amp, ddp=False)
    sums = torch.zeros(3, dtype=torch.float64)
    step(images, SOFT, sums)
    assert sums[0].item() / 2 == pytest.approx(SOFT_LOSS, rel=rel) and sums[1:].tolist() == [1.0, 2.0]
    expected = torch.tensor(P).log() - (torch.tensor(P) - SOFT.mean(0))
    assert torch.allclose(model.logits.detach(), expected, rtol=rel, atol=rel)


def test_fit_on_soft_labels_under_cpu_bf16_autocast():
    batches = _soft(_batches(2))
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    before = _params(model)
    hist = fit(model, ListLoader(batches), epochs=1, amp="bf16", progress=False)
    assert math.isfinite(hist[0]["train_loss"]) and not torch.equal(_params(model), before)
    ev = evaluate(model, ListLoader(batches), amp="bf16")
    ref = evaluate(model, ListLoader(batches), amp="off")
    assert ev["loss"] == pytest.approx(ref["loss"], rel=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_fit_on_soft_labels_under_cuda_autocast(amp):
    """CUDA autocast runs cross-entropy in float32 too: bf16/fp16 logits against float32 soft targets."""
    batches = _soft(_batches(2, device="cuda"))
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, ListLoader(batches, device="cuda"), epochs=2, amp=amp, progress=False)
    assert all(math.isfinite(r["train_loss"]) for r in hist)
    model.eval()
    with torch.no_grad():
        agree = sum((model(x).argmax(1) == y.argmax(1)).sum().item() for x, y in batches)
    assert evaluate(model, ListLoader(batches, device="cuda"), amp="off")["accuracy"] == agree / 32


def test_empty_soft_label_batches_keep_working():
    """An emptied batch with soft labels is (0, classes): skipped in one process, a zero-loss step under
    DDP, and nowhere in the figures."""
    full = _soft(_batches(2))
    empty = (full[0][0][:0], full[0][1][:0])
    assert empty[1].shape == (0, 10)
    torch.manual_seed(0)
    ref = SmallCNN(width=4)
    ref_hist = fit(ref, ListLoader(full), epochs=1, progress=False)
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, ListLoader([full[0], empty, full[1]]), epochs=1, progress=False)
    assert hist[0]["train_loss"] == pytest.approx(ref_hist[0]["train_loss"], rel=1e-6)
    assert hist[0]["train_accuracy"] == ref_hist[0]["train_accuracy"]
    assert torch.equal(_params(model), _params(ref))
    assert evaluate(model, ListLoader([empty]))["samples"] == 0

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), "off", ddp=True)
    sums = torch.zeros(3, dtype=torch.float64)
    step(*empty, sums)                                    # the DDP path: a zero-loss step
    assert sums.tolist() == [0.0, 0.0, 0.0]


def test_soft_labels_with_the_wrong_number_of_classes_are_named():
    model = SmallCNN(width=4)
    step = TrainStep(model, model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(), torch.device("cpu"),
                     "off", ddp=False)
    images, labels = _soft(_batches(1), classes=5)[0]
    with pytest.raises(ValueError, match=r"soft labels of shape \(16, 5\) for logits of shape \(16, 10\).*"
                                         r"num_classes, 10"):
        step(images, labels, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="one column per model output"):
        evaluate(model, ListLoader([(images, labels)]))


def test_fit_trains_on_timm_soft_target_loss_with_mixup_and_evaluates_on_class_indices():
    """timm's recipe: SoftTargetCrossEntropy takes MixUp's (N, classes) targets only. fit used it for the
    eval loader's int64 labels too and crashed after the whole first epoch; the eval loss is now
    cross-entropy on the evaluation labels, whatever the training loss."""
    timm_loss = require("timm.loss")
    from fastdata.batch_transforms import MixUp

    train = make_loader(SyntheticDigits(64, seed=1), "memory", batch_size=32, device="cpu", seed=0,
                        batch_transforms=[MixUp(alpha=0.4)])
    test = make_loader(SyntheticDigits(48, train=False, seed=1), "memory", batch_size=16, train=False, device="cpu")
    seen = []
    soft_loss = timm_loss.SoftTargetCrossEntropy()
    soft_loss.register_forward_pre_hook(lambda module, args: seen.append(args[1].shape))
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, train, epochs=2, eval_loader=test, loss_fn=soft_loss, progress=False)
    assert len(hist) == 2 and seen == [(32, 10)] * 4      # trained on soft targets alone
    # What the run reported is cross-entropy over the eval loader's class indices.
    assert hist[-1]["eval_loss"] == pytest.approx(evaluate(model, test)["loss"], rel=1e-6)
    assert math.isfinite(hist[0]["eval_loss"]) and hist[-1]["eval_accuracy"] is not None


def _concat(batches):
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def test_accumulating_4_batches_of_64_gives_the_weights_of_batches_of_256():
    """10 batches of 64 with accumulate=4 step on groups of 4, 4 and a remainder of 2; the same samples in
    batches of 256, 256 and 128 (each the group's batches concatenated, as fastdata's plan orders them)
    train to the same weights, momentum and per-step schedule included: within atol 1e-5 in float32
    (sums of the same terms in another order)."""
    small = _batches(10, size=64, seed=5)
    large = [_concat(small[i:i + 4]) for i in range(0, 10, 4)]
    runs = []
    for batches, accumulate in ((small, 4), (large, 1)):
        model = _plain_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=3)
        history = fit(model, ListLoader(batches), epochs=2, optimizer=opt, scheduler=sched, accumulate=accumulate,
                      progress=False)
        runs.append((model, history, sched.last_epoch))
    (acc, acc_hist, acc_steps), (big, big_hist, big_steps) = runs
    assert acc_steps == big_steps == 6                     # the schedule counts optimizer steps
    torch.testing.assert_close(_params(acc), _params(big), atol=1e-5, rtol=0)
    for a, b in zip(acc_hist, big_hist):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5) and a["lr"] == pytest.approx(b["lr"])
    model = _plain_net()
    fit(model, ListLoader(small), epochs=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        progress=False)
    assert not torch.allclose(_params(model), _params(big), atol=1e-3)   # without accumulate: other weights


class _FakeDDP(nn.Module):
    """Stands for DistributedDataParallel on the CPU: counts the batches run inside ``no_sync``."""

    def __init__(self, module):
        super().__init__()
        self.module, self.quiet, self.inside = module, 0, False
        self.process_group = object()   # DDP's group: a stand-in, compared by identity

    def forward(self, x):
        self.quiet += self.inside
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_under_ddp_all_but_the_last_batch_of_a_step_run_in_no_sync():
    """One gradient all-reduce per optimizer step: 10 batches in steps of 4, 4 and 2 run 3 + 3 + 1 of
    them inside no_sync; an empty batch (a rank's share of a short last step) still runs its part."""
    model = _plain_net()
    ddp = _FakeDDP(model)
    stepped = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *a: stepped.append(1))
    step = TrainStep(ddp, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), "off", ddp=True, accumulate=4)
    step.eager = ddp
    batches = _batches(10, size=4)
    batches[9] = (batches[9][0][:0], batches[9][1][:0])
    train_one_epoch(step, ListLoader(batches), EpochMeter(torch.device("cpu")))
    assert ddp.quiet == 7 and len(stepped) == 3


def test_an_empty_last_batch_of_a_step_still_steps_on_the_batches_before_it():
    batches = _batches(4, size=8)
    emptied = batches[:1] + [(batches[1][0][:0], batches[1][1][:0])] + batches[2:]
    model = _plain_net()
    fit(model, ListLoader(emptied), epochs=1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
        progress=False)
    # The first step saw one batch (its loss over 1/2: a step of its group's mean, with one batch missing).
    ref = _plain_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for group in ([batches[0]], batches[2:]):
        opt.zero_grad()
        for x, y in group:
            (nn.functional.cross_entropy(ref(x), y) / 2).backward()
        opt.step()
    torch.testing.assert_close(_params(model), _params(ref), atol=1e-6, rtol=0)


class _Says(ListLoader):
    """A loader whose ``len()`` says ``says`` batches whatever it yields (a stream that ends early, a
    ``__len__`` that over- or under-reports)."""

    def __init__(self, batches, says, device="cpu"):
        super().__init__(batches, device)
        self.says = says

    def __len__(self):
        return self.says


class _Unsized:
    """Iteration and a device, no ``len()`` (an iterable of unknown length)."""

    def __init__(self, batches):
        self.batches, self.device = batches, torch.device("cpu")

    def __iter__(self):
        return iter(self.batches)


def _by_hand(batches, groups):
    """The reference: one SGD (momentum) step per group of batch numbers, on the mean of its batches' losses."""
    ref = _plain_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for group in groups:
        opt.zero_grad()
        for k in group:
            x, y = batches[k]
            (nn.functional.cross_entropy(ref(x), y) / len(group)).backward()
        opt.step()
    return _params(ref)


@pytest.mark.parametrize("yields, says, groups", [
    (9, 12, [range(0, 4), range(4, 8), [8]]),            # the last group planned [8, 12): 1 batch came
    (9, 10, [range(0, 4), range(4, 8), [8]]),            # planned [8, 10), the remainder of 2: 1 came
    (6, 12, [range(0, 4), range(4, 6)]),                 # the second group planned whole: 2 of 4 came
    (9, 6, [range(0, 4), range(4, 6), [6], [7], [8]]),   # more than len(): each extra batch steps alone
])
def test_a_loader_yielding_other_than_its_len_steps_on_the_mean_of_what_came(yields, says, groups):
    """accumulate=4: every optimizer step's gradient is the mean over the batches its group really got,
    the trailing group a loader cut short included (it was scaled by 1/the planned group size: with
    one batch of four, a quarter of the step), whatever ``len()`` said."""
    batches = _batches(yields, size=8, seed=3)
    model = _plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped = []
    opt.register_step_post_hook(lambda *a: stepped.append(1))
    fit(model, _Says(batches, says), epochs=1, optimizer=opt, accumulate=4, progress=False)
    assert len(stepped) == len(groups)
    torch.testing.assert_close(_params(model), _by_hand(batches, groups), atol=1e-6, rtol=0)


@pytest.mark.parametrize("yields, groups", [
    (9, [range(0, 4), range(4, 8), [8]]),
    (8, [range(0, 4), range(4, 8)]),
])
def test_train_one_epoch_accumulates_over_a_loader_without_len(yields, groups):
    """fit asks for ``len()``; ``train_one_epoch`` does not: groups of ``accumulate`` from the epoch's
    start, the trailing partial one stepped on the mean of the batches it got."""
    batches = _batches(yields, size=8, seed=4)
    model = _plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep.build(model, FitConfig(epochs=1, optimizer=opt, amp="off", accumulate=4), torch.device("cpu"))
    meter = EpochMeter(torch.device("cpu"))
    train_one_epoch(step, _Unsized(batches), meter)
    assert meter.images == 8 * yields and step.accumulated == 0
    torch.testing.assert_close(_params(model), _by_hand(batches, groups), atol=1e-6, rtol=0)


def test_under_ddp_a_group_cut_short_is_all_reduced_before_its_step(monkeypatch):
    """The batches of a group the loader cut short all ran in ``no_sync`` (a batch is known to be the
    last only when the next ``next()`` ends the loop): its gradients are averaged over the ranks by hand,
    in one all-reduce a gradient, then rescaled, before the step. Two ranks stubbed: the peer's
    gradients are this rank's times 3, so the average is twice this rank's."""
    import torch.distributed as dist

    reduced = []

    def all_reduce(t, op=None, group=None):
        assert group is ddp.process_group   # DDP's own group, which may not be the default one
        reduced.append(t.shape)
        t.mul_(4)   # this rank's + the peer's 3x

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is ddp.process_group else 5)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    batches = _batches(9, size=8, seed=3)
    model = _plain_net()
    ddp = _FakeDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(ddp, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), "off", ddp=True, accumulate=4)
    step.eager = ddp
    ref = _plain_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for group, factor in ((range(0, 4), 1), (range(4, 8), 1), ([8], 2)):
        ref_opt.zero_grad()
        for k in group:
            (nn.functional.cross_entropy(ref(batches[k][0]), batches[k][1]) * factor / len(group)).backward()
        ref_opt.step()
    train_one_epoch(step, _Says(batches, 12), EpochMeter(torch.device("cpu")))
    assert ddp.quiet == 3 + 3 + 1 and reduced == [p.shape for p in model.parameters()]
    torch.testing.assert_close(_params(model), _params(ref), atol=1e-6, rtol=0)


SHORT_DDP_SCRIPT = """
import json
import torch
from fastdata import distributed as fdist
from fastdata.engine import fit
from engine_helpers import ListLoader, _batches, _params, _plain_net

fdist.init_distributed("cpu")
rank = fdist.rank()

class Says(ListLoader):
    def __len__(self): return 6   # 5 batches come: the second group, planned [4, 6), gets one

model = _plain_net()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
fit(model, Says(_batches(5, size=8, seed=10 + rank)), epochs=2, optimizer=opt, accumulate=4, progress=False)
with open(f"rank{rank}.json", "w") as f:
    json.dump({"params": _params(model).tolist()}, f)
fdist.cleanup()
"""


def test_two_ranks_whose_loaders_end_early_step_alike_on_the_mean_of_what_came(tmp_path, monkeypatch):
    """Two gloo ranks, each loader saying 6 batches and yielding 5, accumulate=4, two epochs: the
    cut-short group's batch ran in no_sync on each rank; both replicas still end equal (its gradients
    were all-reduced), at the weights of one model stepped on the mean over both ranks' batches of each
    group."""
    from test_distributed import _torchrun

    here = str(Path(__file__).parent)   # the ranks import engine_helpers, as this file does
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    r0, r1 = _torchrun(SHORT_DDP_SCRIPT, [], tmp_path)
    ranks = [_batches(5, size=8, seed=10 + r) for r in (0, 1)]
    ref = _plain_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for group in (range(0, 4), [4]) * 2:   # two epochs: DDP's reducer goes on after the hand-made reduce
        opt.zero_grad()
        for batches in ranks:
            for k in group:
                x, y = batches[k]
                (nn.functional.cross_entropy(ref(x), y) / (2 * len(group))).backward()
        opt.step()
    assert r0["params"] == r1["params"]
    torch.testing.assert_close(torch.tensor(r0["params"]), _params(ref), atol=1e-6, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])   # fp16: the default AdamW is fused, its scaler reads nothing
def test_a_group_cut_short_steps_without_a_host_sync_on_a_gpu(amp):
    """A loader saying 8 batches and yielding 6 under accumulate=4: the trailing group's rescale and step
    run under sync debug mode "error" (after a warm epoch: cuDNN's choice, the optimizer's state)."""
    from conftest import sync_debug_error

    device = torch.device("cuda")
    batches = _batches(6, size=64, device="cuda")
    model = SmallCNN(width=8)
    step = TrainStep.build(model, FitConfig(epochs=1, amp=amp, accumulate=4), device)
    train_one_epoch(step, ListLoader(batches[:4], device="cuda"), EpochMeter(device))
    meter = EpochMeter(device)
    before = _params(model)
    torch.cuda.synchronize()
    with sync_debug_error():
        train_one_epoch(step, _Says(batches, 8, device="cuda"), meter)
    assert step.accumulated == 0 and meter.images == 6 * 64
    assert not torch.equal(_params(model), before)


def test_clipping_bounds_a_huge_step_to_the_manually_clipped_one():
    """lr 100: unclipped, the step is enormous; clipped to norm 0.5 it equals clip_grad_norm_ by hand, and
    the record's grad_norm is the norm before clipping."""
    (x, y), = _batches(1, size=16, seed=2)
    ref = _plain_net()
    nn.functional.cross_entropy(ref(x), y).backward()
    norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 100 * p.grad
    model = _plain_net()
    (record,) = fit(model, ListLoader([(x, y)]), epochs=1, optimizer=torch.optim.SGD(model.parameters(), lr=100.0),
                    clip_grad_norm=0.5, progress=False)
    torch.testing.assert_close(_params(model), _params(ref), atol=1e-5, rtol=1e-5)
    assert record["grad_norm"] == pytest.approx(norm.item(), rel=1e-5) and norm.item() > 0.5
    start = _params(_plain_net())
    assert (_params(model) - start).norm() <= 100 * 0.5 * 1.001          # bounded by lr x clip
    unclipped = _plain_net()
    (plain,) = fit(unclipped, ListLoader([(x, y)]), epochs=1, progress=False,
                   optimizer=torch.optim.SGD(unclipped.parameters(), lr=100.0))
    assert (_params(unclipped) - start).norm() > 100 * 0.5 * 1.5 and "grad_norm" not in plain


def test_ema_after_k_steps_is_the_reference_recurrence_and_is_what_is_evaluated():
    from fastdata.engine import ModelEma

    model = _plain_net()
    ema = ModelEma(model, 0.8)
    avg = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def follow(*_):   # the recurrence, from the weights after every optimizer step
        for a, p in zip(avg, model.parameters()):
            a.mul_(0.8).add_(p.detach(), alpha=0.2)

    opt.register_step_post_hook(follow)
    loader = ListLoader(_batches(5, size=8))
    (record,) = fit(model, loader, epochs=1, optimizer=opt, ema=ema, eval_loader=loader, progress=False)
    for a, e in zip(avg, ema.module.parameters()):
        torch.testing.assert_close(e, a, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(_params(ema.module), _params(model))
    assert record["eval_ema"] is True
    assert record["eval_loss"] == pytest.approx(evaluate(ema.module, loader)["loss"], rel=1e-6)
    assert record["eval_loss"] != pytest.approx(evaluate(model, loader)["loss"], rel=1e-6)


def test_a_resume_with_accumulate_clip_and_ema_gives_the_uninterrupted_run(tmp_path):
    """checkpoint_every=3 under accumulate=2: the save due after batch 3 waits for the step's end (batch 4),
    so no checkpoint holds half a step; the crash after 5 batches resumes from batch 4 to the uninterrupted
    run's weights and weight average; the checkpoint keeps the average."""
    from fastdata.engine import ModelEma

    batches = _batches(7, size=8, seed=9)

    def run(loader, path, resume):
        model = _plain_net()
        ema = ModelEma(model, 0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        fit(model, loader, epochs=2, optimizer=opt, accumulate=2, clip_grad_norm=1.0, ema=ema, checkpoint=path,
            checkpoint_every=3, resume=resume, progress=False)
        return model, ema

    whole, whole_ema = run(ListLoader(batches), tmp_path / "whole.pt", False)
    path = tmp_path / "c.pt"
    with pytest.raises(Crash):
        run(Recording(ListLoader(batches), crash_after=5), path, False)
    saved = torch.load(path, weights_only=True)
    assert saved["loader"] == {"epoch": 0, "batch": 4} and saved["ema"] is not None
    model, ema = run(ListLoader(batches), path, True)
    torch.testing.assert_close(_params(model), _params(whole), atol=0, rtol=0)
    torch.testing.assert_close(_params(ema.module), _params(whole_ema.module), atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_accumulate_clip_and_ema_under_amp_on_a_gpu(amp):
    from fastdata.engine import ModelEma

    model = _plain_net()
    ema = ModelEma(model, 0.9)
    loader = ListLoader(_batches(7, size=16, device="cuda"), device="cuda")
    history = fit(model, loader, epochs=2, amp=amp, accumulate=3, clip_grad_norm=1.0, ema=ema, eval_loader=loader,
                  progress=False)
    assert all(math.isfinite(r[k]) for r in history for k in ("train_loss", "eval_loss", "grad_norm"))
    assert history[-1]["eval_ema"] is True and ema.module.training is False
    assert not torch.allclose(_params(ema.module), _params(model))
    assert all(torch.isfinite(p).all() for p in ema.module.parameters())


def test_fit_gradient_checkpointing_trains_the_same_weights(tmp_path):
    batches = _batches(4, size=16)
    trained = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = SmallCNN(width=4)
        fit(model, ListLoader(batches), epochs=1, amp="off", progress=False, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9), gradient_checkpointing=checkpointing)
        trained.append(model)
    assert type(trained[1].features).__name__ == "CheckpointedSequential"   # it was switched on
    torch.testing.assert_close(_params(trained[1]), _params(trained[0]), atol=1e-5, rtol=0)
    for a, b in zip(trained[0].buffers(), trained[1].buffers()):   # BatchNorm statistics moved once per step
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_fit_refuses_a_model_gradient_checkpointing_cannot_split_before_training():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc(x.flatten(1))

    loader = ListLoader(_batches(2))
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True.*cannot split a .*Plain"):
        fit(Plain(), loader, epochs=1, progress=False, gradient_checkpointing=True)
    assert loader.iters == 0
