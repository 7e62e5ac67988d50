"""Second QA pass of the bundled training engine as a user runs it (fastdata/engine/*, fastdata/runlog.py):
a model the user compiled, a loss that goes NaN, the run log after a resume."""

import torch

from engine_helpers import ListLoader, _batches, _params
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
