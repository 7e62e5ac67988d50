"""QA of fit as a user of another loader meets it (fastdata/engine/loop.py, state.py): a loader that keeps
only the contract fit's own error states (``.device``, ``len()``, iteration over ``(images, labels)``),
a loader of dicts, and a run killed with SIGKILL in a subprocess resumed in a fresh one."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine_helpers import ListLoader, _batches, _params
from fastdata import checkpoint as ckpt
from fastdata.engine import evaluate, fit
from fastdata.models import SmallCNN

ROOT = Path(__file__).resolve().parents[1]


class Minimal:
    """What fit's refusal of a plain DataLoader asks for, and nothing else: a device, a length, and a
    fresh pass over (images, labels) on each ``iter()`` (no set_epoch, no state_dict)."""

    def __init__(self, batches):
        self.batches, self.device = list(batches), torch.device("cpu")

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def test_a_loader_with_just_device_len_and_iteration_trains_like_a_contract_loader():
    """fit's TypeError for a plain DataLoader says the contract is ``.device, len(), iteration``; an
    object with exactly that died with AttributeError: 'Minimal' object has no attribute 'set_epoch'.
    It now trains (no checkpoint: nothing needs its position) to the weights of a full contract loader."""
    runs = []
    for loader in (Minimal(_batches(4)), ListLoader(_batches(4))):
        torch.manual_seed(0)
        model = SmallCNN(width=4)
        history = fit(model, loader, epochs=2, eval_loader=Minimal(_batches(2, seed=1)), progress=False)
        runs.append((_params(model), history))
    (got, hist), (ref, ref_hist) = runs
    assert torch.equal(got, ref)
    assert [r["epoch"] for r in hist] == [1, 2] and hist[-1]["images"] == 64
    assert hist[-1]["eval_accuracy"] == ref_hist[-1]["eval_accuracy"]


def test_a_checkpoint_with_a_loader_without_a_position_is_refused_before_training(tmp_path):
    """With ``checkpoint=`` the position is the loader's ``state_dict``: a loader without it was an
    AttributeError from inside the checkpoint code. Now a TypeError names what is missing and why,
    before the model is touched."""
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    before = _params(model)
    with pytest.raises(TypeError, match=r"checkpoint= needs train_loader's position: Minimal has no "
                                        r"state_dict, load_state_dict"):
        fit(model, Minimal(_batches(2)), epochs=1, checkpoint=tmp_path / "c.pt", progress=False)
    assert torch.equal(_params(model), before) and not (tmp_path / "c.pt").exists()


class Dicts(ListLoader):
    """A loader of dicts (a DALI iterator's or a Hugging Face collate's output)."""

    def __iter__(self):
        for images, labels in super().__iter__():
            yield {"images": images, "labels": labels}


def test_a_loader_of_dicts_or_triples_is_named_not_a_str_has_no_dtype():
    """A dict batch unpacked into ``images, labels`` gave the keys: "AttributeError: 'str' object has no
    attribute 'dtype'"; a triple gave "too many values to unpack". Both are now a TypeError naming the
    loader and what it yields."""
    with pytest.raises(TypeError, match=r"train_loader must yield \(images, labels\) pairs of tensors; it "
                                        r"yielded a dict with keys \['images', 'labels'\]"):
        fit(SmallCNN(width=4), Dicts(_batches(2)), epochs=1, progress=False)
    triples = [(x, y, y) for x, y in _batches(2)]
    with pytest.raises(TypeError, match=r"train_loader must yield \(images, labels\) .* a tuple of 3"):
        fit(SmallCNN(width=4), ListLoader(triples), epochs=1, progress=False)
    with pytest.raises(TypeError, match=r"the evaluation loader must yield \(images, labels\) .* a dict"):
        evaluate(SmallCNN(width=4), Dicts(_batches(2)))


KILLED_SCRIPT = """
import os, signal, sys
import torch
from fastdata import Augmentation, make_loader
from fastdata.datasets import SyntheticDigits
from fastdata.engine import fit
from fastdata.models import SmallCNN

path, out, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
torch.manual_seed(123 if resume else 0)   # a resume must not depend on the new process's seed
loader = make_loader(SyntheticDigits(384, seed=5), "memory", batch_size=64, device="cpu", seed=3,
                     augment=Augmentation(crop="translate", pad=3, hflip=0.5))
model = SmallCNN(width=4)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
base, calls = torch.nn.CrossEntropyLoss(), [0]

def loss_fn(logits, labels):
    calls[0] += 1
    if calls[0] == kill_at:   # no cleanup of any kind runs: as a machine lost or an OOM killer
        os.kill(os.getpid(), signal.SIGKILL)
    return base(logits, labels)

fit(model, loader, epochs=2, optimizer=opt, checkpoint=path, resume=resume, checkpoint_every=2,
    progress=False, loss_fn=loss_fn, ema=0.9, accumulate=2)
torch.save(model.state_dict(), out)
"""


def test_a_run_killed_with_sigkill_resumes_in_a_new_process_to_the_uninterrupted_weights(tmp_path):
    """The in-process resume tests raise an exception; here the process dies with SIGKILL mid-epoch 2
    (no finally, no atexit) and a fresh process (another torch seed) resumes: weights and the EMA equal
    the uninterrupted run's bit for bit (augmentation, momentum, accumulate 2 included)."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(KILLED_SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def run(*args):
        return subprocess.run([sys.executable, str(script), *map(str, args)], env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    ref = run(tmp_path / "ref.pt", tmp_path / "ref_w.pt", 0, 0)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = run(tmp_path / "c.pt", tmp_path / "x.pt", 9, 0)   # 6 batches an epoch: batch 3 of epoch 2
    assert killed.returncode == -9 and not (tmp_path / "x.pt").exists()
    resumed = run(tmp_path / "c.pt", tmp_path / "res_w.pt", 0, 1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "epoch 2, batch 2/6" in resumed.stdout
    a, b = torch.load(tmp_path / "ref_w.pt"), torch.load(tmp_path / "res_w.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the uninterrupted run"
    ema_ref, ema_got = ckpt.load(tmp_path / "ref.pt")["ema"], ckpt.load(tmp_path / "c.pt")["ema"]
    assert all(torch.equal(ema_ref[k], ema_got[k]) for k in ema_ref)


def _moved(batches, images_to=None, labels_to=None):
    return [(x.to(images_to or x.device), y.to(labels_to or y.device)) for x, y in batches]


def test_batches_on_another_device_than_the_loader_says_are_named():
    """A loader of one's own that says ``device="cuda:0"`` and yields CPU tensors (a wrapped DataLoader:
    fit moves nothing) failed inside the model with torch's "Input type ... and weight type ... should be
    the same", naming neither the loader nor the cure. The meta device stands for the other device on a
    CPU-only machine."""
    with pytest.raises(ValueError, match=r"train_loader says its batches are on cpu but yielded images on meta: "
                                         r"fit does not move batches"):
        fit(SmallCNN(width=4), ListLoader(_moved(_batches(2), images_to="meta")), epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"train_loader says .* on cpu but yielded labels on meta"):
        fit(SmallCNN(width=4), ListLoader(_moved(_batches(2), labels_to="meta")), epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"the evaluation loader says .* on cpu but yielded images on meta"):
        evaluate(SmallCNN(width=4), ListLoader(_moved(_batches(2), images_to="meta")))


@pytest.mark.cuda
def test_cpu_batches_from_a_loader_that_says_cuda_are_named_on_a_gpu():
    loader = ListLoader(_batches(2), device="cuda:0")   # yields the CPU tensors it was given
    with pytest.raises(ValueError, match=r"train_loader says its batches are on cuda:0 but yielded images on cpu"):
        fit(SmallCNN(width=4), loader, epochs=1, progress=False)


def test_evaluate_names_a_plain_dataloader_as_fit_does():
    """fit refuses a plain DataLoader with a hint; evaluate, the other public entry, raised
    "AttributeError: 'DataLoader' object has no attribute 'device'"."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1, 28, 28),
                                                                      torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TypeError, match=r"loader must be a fastdata loader .* got DataLoader without device: "
                                        r"a torch DataLoader does not say where its batches are"):
        evaluate(SmallCNN(width=4), data)
