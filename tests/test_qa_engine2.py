"""Second QA pass of the bundled training engine as a user runs it (fastdata/engine/*, fastdata/runlog.py):
a model the user compiled, a loss that goes NaN, the run log after a resume."""

import math

import pytest
import torch

from engine_helpers import Crash, ListLoader, Recording, _batches, _params, _plain_net
from fastdata import checkpoint as ckpt
from fastdata.engine import fit
from fastdata.models import SmallCNN


def _counting_backend(calls):
    """A torch.compile backend that runs the traced graph eagerly and counts the graphs compiled: what
    fit ran went through the user's compiled module (inductor would cost a minute on these cores)."""
    def backend(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward
    return backend


def test_a_model_the_user_compiled_checkpoints_plain_weights_and_resumes_both_ways(tmp_path):
    """``fit(torch.compile(model), checkpoint=...)`` saved the OptimizedModule's state_dict: every key
    prefixed ``_orig_mod.``, so the checkpoint resumed neither into the plain model ("holds the weights of
    another model than SmallCNN: 26 missing ... 26 unexpected") nor a plain run's into a compiled model
    ("another model than OptimizedModule"). The weights are now saved and restored as the model's own,
    and training still runs through the user's compiled module."""
    batches = _batches(3, size=8)
    calls = []
    torch.manual_seed(0)
    compiled = torch.compile(SmallCNN(width=4), backend=_counting_backend(calls))
    fit(compiled, ListLoader(batches), epochs=1, checkpoint=tmp_path / "c.pt", progress=False)
    assert calls, "fit did not run the user's compiled module"
    saved = ckpt.load(tmp_path / "c.pt")
    plain = SmallCNN(width=4)
    assert list(saved["model"]) == list(plain.state_dict())
    assert all(torch.equal(saved["model"][k], v) for k, v in compiled._orig_mod.state_dict().items())

    # compiled -> plain: resumes (epoch 2 trains eagerly) from the compiled run's weights.
    history = fit(plain, ListLoader(batches), epochs=2, checkpoint=tmp_path / "c.pt", resume=True, progress=False)
    assert [r["epoch"] for r in history] == [1, 2]

    # plain -> compiled: a finished plain run loads into a compiled model (nothing left to train).
    again = torch.compile(SmallCNN(width=4), backend=_counting_backend([]))
    history = fit(again, ListLoader(batches), epochs=2, checkpoint=tmp_path / "c.pt", resume=True, progress=False)
    assert len(history) == 2
    assert torch.equal(_params(again._orig_mod), _params(plain))


class GoesNan:
    """Cross-entropy, NaN from call ``at`` on (``once``: at that call alone), as a diverging run's loss."""

    def __init__(self, at, once=False):
        self.at, self.once, self.calls = at, once, 0

    def __call__(self, logits, labels):
        self.calls += 1
        loss = torch.nn.functional.cross_entropy(logits, labels)
        bad = self.calls == self.at if self.once else self.calls >= self.at
        return loss * float("nan") if bad else loss


def _diverging_run(path, loss_fn, **options):
    torch.manual_seed(0)
    model = _plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, fit(model, ListLoader(_batches(4, size=8)), epochs=3, optimizer=opt, loss_fn=loss_fn,
                      checkpoint=path, checkpoint_every=2, progress=False, **options)


@pytest.mark.parametrize("at, batch, saved", [(7, 3, {"epoch": 1, "batch": 2}), (5, 1, {"epoch": 1, "batch": 0})])
def test_a_loss_that_goes_nan_stops_the_run_naming_the_batch_and_keeps_the_last_good_checkpoint(tmp_path, at,
                                                                                                  batch, saved):
    """A loss that went NaN said nothing but "loss nan" in the epoch's line; the run trained on, on NaN
    weights, and its next save (at the epoch's end, or a checkpoint_every one) wrote them over the last
    good checkpoint: the work before the divergence was lost. Now the first save after it raises
    FloatingPointError naming the epoch and batch where the loss went non-finite, and writes nothing."""
    path = tmp_path / "c.pt"
    with pytest.raises(FloatingPointError, match=rf"the training loss went non-finite at epoch 2, batch {batch}/4.*"
                                                 rf"weights are not finite .*0\.weight.*'{path}' keeps"):
        _diverging_run(path, GoesNan(at))
    state = ckpt.load(path)
    assert state["loader"] == saved
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_loss_nan_for_one_batch_that_fp16_skipped_warns_naming_it_and_trains_on(tmp_path):
    """Under fp16 the scaler skips the step of a NaN loss: the weights stay finite, so the run goes on,
    and the epoch's NaN loss is explained by a warning naming its batch."""
    with pytest.warns(RuntimeWarning, match=r"the training loss went non-finite at epoch 1, batch 2/4.*the "
                                            r"weights are finite"):
        model, history = _diverging_run(tmp_path / "c.pt", GoesNan(2, once=True), amp="fp16")
    assert math.isnan(history[0]["train_loss"]) and math.isfinite(history[1]["train_loss"])
    assert torch.isfinite(_params(model)).all()


def _tensorboard_steps(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """A crash two batches after the last checkpoint: the resumed run logs those batches again. steps.csv
    replaced the repeated rows, but TensorBoard got them twice ([.., 6, 7, 6, 7, 8, ..]): the run's curve
    doubled back on itself. fit now opens the writer with purge_step at the step it resumes from."""
    pytest.importorskip("tensorboard")
    log = tmp_path / "log"

    def run(resume, crash=None):
        loader = Recording(ListLoader(_batches(5, size=8)), crash)
        return fit(_plain_net(), loader, epochs=3, checkpoint=tmp_path / "c.pt", checkpoint_every=3, resume=resume,
                   log_dir=log, log_every=1, progress=False)

    with pytest.raises(Crash):
        run(False, crash=8)   # saved after batch 6; batches 6 and 7 were logged and are redone
    run(True)
    assert _tensorboard_steps(log, "step/loss") == list(range(15))
    assert _tensorboard_steps(log, "train/loss") == [1, 2, 3]
    # A fresh run into the same folder starts the curves over, as its CSVs do.
    fit(_plain_net(), ListLoader(_batches(5, size=8)), epochs=1, log_dir=log, log_every=1, progress=False)
    assert _tensorboard_steps(log, "step/loss") == list(range(5))
    assert _tensorboard_steps(log, "train/loss") == [1]


class PoisonAt(torch.optim.SGD):
    """SGD whose step number ``at`` writes a NaN into the weights (an overflow in an update), the loss of
    the batches before it finite."""

    def __init__(self, params, at):
        super().__init__(params, lr=0.01)
        self.at, self.steps = at, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        self.steps += 1
        if self.steps == self.at:
            self.param_groups[0]["params"][0].fill_(math.nan)


def test_nan_weights_are_never_saved_over_the_last_checkpoint_even_with_a_finite_loss(tmp_path):
    """A step wrote a NaN into the weights right before a save: the loss so far was finite (computed before
    the step), so nothing in the figures said so, and the save replaced the last good checkpoint. (At an
    epoch's end the weights are checked anyway: see the next test.)"""
    torch.manual_seed(0)
    model = _plain_net()
    path = tmp_path / "c.pt"
    with pytest.raises(FloatingPointError, match=rf"not saving '{path}': the model's weights are not finite "
                                                 rf"\(0\.weight\); it keeps the last save before them"):
        fit(model, ListLoader(_batches(3, size=8)), epochs=1, optimizer=PoisonAt(model.parameters(), at=2),
            checkpoint=path, checkpoint_every=1, progress=False)
    state = ckpt.load(path)
    assert state["loader"] == {"epoch": 0, "batch": 1}
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_weights_gone_non_finite_with_a_finite_loss_stop_the_run_at_the_epochs_end_without_a_checkpoint():
    """BatchNorm's running variance overflowed (a huge learning rate) while the loss, computed on each
    batch's own statistics, stayed finite: the run trained on, every evaluation on broken statistics; with
    a checkpoint it stopped at the first save, without one never. The epoch's end now checks the weights."""
    torch.manual_seed(0)
    model = _plain_net()
    with pytest.raises(FloatingPointError, match=r"in epoch 1 \(this rank's training loss stayed finite\), and the "
                                                 r"model's weights are not finite \(0\.weight\).*no checkpoint"):
        fit(model, ListLoader(_batches(2, size=8)), epochs=3, optimizer=PoisonAt(model.parameters(), at=2),
            progress=False)


def _sgd_run(path, *, scheduler: bool, epochs: int, resume=False):
    torch.manual_seed(0)
    model = _plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=3, steps_per_epoch=4) if scheduler else None
    fit(model, ListLoader(_batches(4, size=8)), epochs=epochs, optimizer=opt, scheduler=sched, checkpoint=path,
        resume=resume, progress=False)
    return model


def test_a_scheduler_on_one_side_of_a_resume_only_is_refused_naming_it(tmp_path):
    """Resumed without the checkpoint's OneCycleLR, the run went on at the rate the schedule had reached
    (0.0933, to the end) without a word; resumed with a scheduler the checkpoint lacks, it warned that "the
    steps per epoch changed" and died at its first step with KeyError: 'initial_lr', after the model had
    been overwritten. Both are now a ResumeError naming the scheduler, before anything is restored."""
    with_it, without = tmp_path / "with.pt", tmp_path / "without.pt"
    _sgd_run(with_it, scheduler=True, epochs=1)
    _sgd_run(without, scheduler=False, epochs=1)
    with pytest.raises(ckpt.ResumeError, match=rf"'{with_it}' was trained with a OneCycleLR scheduler and this "
                                               rf"run has none"):
        _sgd_run(with_it, scheduler=False, epochs=3, resume=True)
    with pytest.raises(ckpt.ResumeError, match=rf"'{without}' was trained without a scheduler and this run has a "
                                               rf"OneCycleLR"):
        _sgd_run(without, scheduler=True, epochs=3, resume=True)
    # Each resumes as it was saved.
    _sgd_run(with_it, scheduler=True, epochs=2, resume=True)
    _sgd_run(without, scheduler=False, epochs=2, resume=True)


def test_a_diverging_example_run_ends_in_one_line_naming_what_went_non_finite(tmp_path, capsys):
    """train_mnist with a learning rate that blows the weights up: fit's FloatingPointError (no NaN saved
    over the checkpoint) reached the shell as a traceback through the loop and the checkpoint code; the
    examples end a checkpoint problem in one line, and now this one too."""
    from conftest import load_example

    module = load_example("train_mnist")
    path = tmp_path / "c.pt"
    argv = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "512", "--test-size", "64",
            "--batch-size", "64", "--backend", "memory", "--device", "cpu", "--no-progress", "--epochs", "2",
            "--lr", "1e5", "--checkpoint", str(path), "--checkpoint-every", "3"]
    with pytest.raises(SystemExit) as info:
        module.run(argv)
    assert str(info.value.code).startswith(f"error: not saving '{path}': the model's weights are not finite (")
    assert "Traceback" not in capsys.readouterr().err


def test_resuming_with_another_accumulate_names_it_among_the_causes_of_a_shorter_schedule(tmp_path):
    """A run saved under accumulate=1 resumed with accumulate=2: half the steps per epoch, so the restored
    one-cycle schedule stops mid-anneal. The warning said "another world size or batch size", neither of
    which had changed; it now names accumulate too."""
    path = tmp_path / "c.pt"

    def run(epochs, accumulate, resume):
        torch.manual_seed(0)
        model = _plain_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=2, steps_per_epoch=-(-4 // accumulate))
        fit(model, ListLoader(_batches(4, size=8)), epochs=epochs, optimizer=opt, scheduler=sched,
            accumulate=accumulate, checkpoint=path, resume=resume, progress=False)

    run(1, 1, False)
    with pytest.warns(RuntimeWarning, match=r"total_steps=8 but this run ends it at step 6 \(the steps per epoch "
                                            r"changed: another world size, batch size or accumulate"):
        run(2, 2, True)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the learning rate of every step it takes."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.rates = []

    @torch.no_grad()
    def step(self, closure=None):
        self.rates.append(self.param_groups[0]["lr"])
        return super().step(closure)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_step_log_gives_each_batch_the_rate_it_trained_at(tmp_path, accumulate):
    """Under a per-step schedule steps.csv (and TensorBoard's step/lr) gave each row the rate the *next*
    step would use (read after the scheduler stepped): the curve ran one step ahead, and its last point
    was torch's extrapolation past OneCycleLR's end (0.028 where the schedule ends at 4e-07), a rate no
    step used. The epoch record had been fixed for this; now every row has its own step's rate (a batch
    inside an accumulation group: the rate its group's step uses)."""
    import csv

    torch.manual_seed(0)
    model = _plain_net()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    steps = -(-6 // accumulate)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, epochs=2, steps_per_epoch=steps)
    fit(model, ListLoader(_batches(6, size=8)), epochs=2, optimizer=opt, scheduler=sched, accumulate=accumulate,
        log_dir=tmp_path, log_every=1, progress=False)
    logged = [float(r["lr"]) for r in csv.DictReader(open(tmp_path / "steps.csv"))]
    assert logged == [opt.rates[b // accumulate] for b in range(12)]


@pytest.mark.parametrize("loss_fn, what", [
    (torch.nn.CrossEntropyLoss(reduction="none"), r"a tensor of shape \(8,\)"),
    (lambda logits, labels: (logits.sum(), 1), r"a tuple"),
    (lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels).item(), r"a float"),
    (lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels).detach(),
     r"a tensor that does not require grad"),
])
def test_a_loss_fn_that_returns_no_scalar_loss_is_named(loss_fn, what):
    """A per-sample loss (reduction='none'), a tuple, a float (.item()) or a detached tensor failed inside
    autograd or the step ("grad can be implicitly created only for scalar outputs", "'tuple' object has
    no attribute 'backward'"), naming neither the loss function nor the cure."""
    with pytest.raises(TypeError, match=rf"loss_fn returned {what}.*: fit needs the batch's loss as one number"):
        fit(_plain_net(), ListLoader(_batches(2, size=8)), epochs=1, loss_fn=loss_fn, progress=False)


def test_evaluate_names_a_per_sample_loss_too():
    from fastdata.engine import evaluate

    with pytest.raises(TypeError, match=r"the evaluation loss \(evaluate's loss_fn, fit's eval_loss_fn\) returned "
                                        r"a tensor of shape \(8,\)"):
        evaluate(_plain_net(), ListLoader(_batches(2, size=8)), loss_fn=torch.nn.CrossEntropyLoss(reduction="none"))
    one = evaluate(_plain_net(), ListLoader(_batches(2, size=8)),
                   loss_fn=lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels).reshape(1))
    assert math.isfinite(one["loss"])   # a one-element tensor is a loss too


class ReturnsTuple(torch.nn.Module):
    """A model returning (logits, aux_logits), as torchvision's inception_v3 and googlenet do in training."""

    def __init__(self):
        super().__init__()
        self.net = _plain_net()

    def forward(self, x):
        logits = self.net(x)
        return logits, logits


class ReturnsDict(ReturnsTuple):
    """A model returning a dict (a Hugging Face model's output)."""

    def forward(self, x):
        return {"logits": self.net(x)}


@pytest.mark.parametrize("model, what", [(ReturnsTuple, r"a tuple of 2 \(Tensor, Tensor\)"),
                                         (ReturnsDict, r"a dict with keys \['logits'\]")])
def test_a_model_that_returns_more_than_its_logits_is_named(model, what):
    """fit and evaluate failed with "'tuple' object has no attribute 'ndim'" inside the label check."""
    from fastdata.engine import evaluate

    with pytest.raises(TypeError, match=rf"the model returned {what}: fit and evaluate need its logits"):
        fit(model(), ListLoader(_batches(2, size=8)), epochs=1, progress=False)
    with pytest.raises(TypeError, match=rf"the model returned {what}"):
        evaluate(model(), ListLoader(_batches(2, size=8)))
