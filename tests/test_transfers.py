"""The host<->device budget of a round, counted on the CPU: the shipped loops (engine/spec/loop.py's
``generate``, the draft leader in its thread) run answers on a tiny model, greedy, penalised and sampled,
with a TransferCounter in each leader's thread; every target round may copy to the device once and read
back once, every draft expansion likewise, and a draft re-root may copy its KV moves once. The counter
itself is checked on the operations it must see, and a planted read is caught."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny_models import single_thread, tiny_model_dir

from swiftspec.engine.config import SamplingParams, TreeParams
from swiftspec.engine.model.loader import load_model
from swiftspec.engine.spec import loop
from swiftspec.engine.spec.decode import DraftState, TargetState
from swiftspec.engine.spec.drafters import ModelDrafter, SuffixDrafter
from swiftspec.engine.spec.sampling import Sampler
from swiftspec.engine.spec.transfers import Staging, TransferCounter

PROMPT = [5, 17, 300, 42, 8, 99, 17, 300]
SETTINGS = {
    "greedy": SamplingParams(),
    "penalised": SamplingParams(repeat_penalty=1.3, presence_penalty=0.5, repeat_last_n=16),
    "sampled": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=3),
}


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """The rounds as a GPU runs them: on the CPU, Staging and the Sampler take the host's own ways (numpy
    inputs, the kernels' choice), which move nothing."""
    monkeypatch.setattr(Staging, "on_host", property(lambda self: False))
    monkeypatch.setattr(Sampler, "_in_kernels", False)


@pytest.fixture(scope="module")
def models():
    """Target and draft on torch's own linears and the reference kernels (the model code a GPU runs,
    without Triton), in one thread."""
    target_dir = tiny_model_dir(seed=1)
    with single_thread():
        yield tuple(load_model(target_dir, max_slots=512, batch_invariant=False) for _ in range(2))


class Budget:
    """Counts per call of the wrapped methods, each call in its own thread's counter."""

    def __init__(self):
        self.per_call: dict[str, list[tuple[int, int, dict]]] = {}

    def wrap(self, monkeypatch, cls, name: str) -> None:
        real = getattr(cls, name)

        def counted(*args, **kwargs):
            with TransferCounter() as counter:
                out = real(*args, **kwargs)
            self.per_call.setdefault(name, []).append((counter.up, counter.down, dict(counter.calls)))
            return out

        monkeypatch.setattr(cls, name, counted)

    def worst(self, name: str) -> tuple[int, int]:
        calls = self.per_call[name]
        return max(c[0] for c in calls), max(c[1] for c in calls)


def run_counted(monkeypatch, target_model, drafter, params: SamplingParams, mode: str) -> Budget:
    budget = Budget()
    for cls, name in ((TargetState, "verify"), (DraftState, "expand"), (DraftState, "reroot")):
        budget.wrap(monkeypatch, cls, name)
    target = TargetState(target_model, 512)
    draft = DraftState(drafter, TreeParams(bs=4, w=2)) if mode != "ar" else None
    steps = loop.generate(target, draft, PROMPT, replace(params, mode=mode, max_new_tokens=24, ignore_eos=True), d=2)
    assert sum(len(s.tokens) for s in steps) == 24
    return budget


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("mode", ["ar", "sync", "async"])
def test_a_target_round_moves_once_each_way(models, monkeypatch, setting, mode):
    target_model, draft_model = models
    budget = run_counted(monkeypatch, target_model, ModelDrafter(draft_model), SETTINGS[setting], mode)
    assert budget.worst("verify") == (1, 1), budget.per_call["verify"]
    if mode != "ar":
        assert budget.worst("expand") == (1, 1), budget.per_call["expand"]
        assert budget.worst("reroot")[0] <= 1 and budget.worst("reroot")[1] == 0, budget.per_call["reroot"]


def test_the_suffix_drafter_touches_no_device(models, monkeypatch):
    budget = run_counted(monkeypatch, models[0], SuffixDrafter(), SETTINGS["sampled"], "async")
    assert budget.worst("expand") == budget.worst("reroot") == (0, 0)
    assert budget.worst("verify") == (1, 1)


def test_a_planted_read_is_caught(models, monkeypatch):
    """A round that reads one value of the verification early (as float(p[x]) did) breaks the budget."""
    real = Sampler.choose
    monkeypatch.setattr(Sampler, "choose", lambda self, logits: (float(logits[0, 0]), real(self, logits))[1])
    budget = run_counted(monkeypatch, models[0], SuffixDrafter(), SETTINGS["greedy"], "sync")
    assert budget.worst("verify") == (1, 2)


def test_the_counter_sees_every_kind_of_transfer():
    x = torch.arange(6.0)
    host = [1, 2, 3]
    reads = [lambda: x.tolist(), lambda: x[0].item(), lambda: bool(x[1]), lambda: float(x[1]), lambda: int(x[2]),
             lambda: x.cpu(), lambda: x[x > 2], lambda: x.nonzero(),
             lambda: torch.multinomial(x + 1, 1)]
    writes = [lambda: torch.tensor(host, device="cpu"), lambda: torch.as_tensor(np.array(host), device="cpu"),
              lambda: x.to("cpu"), lambda: x.to(torch.device("cpu"), torch.float16), lambda: x.clone().copy_(x)]
    quiet = [lambda: x.to(torch.float16), lambda: torch.tensor(host), lambda: x[1:3] * 2, lambda: x.argmax(),
             lambda: torch.arange(3, device="cpu")]
    for ops, up, down in ((reads, 0, 1), (writes, 1, 0), (quiet, 0, 0)):
        for op in ops:
            with TransferCounter() as counter:
                op()
            assert (counter.up, counter.down) == (up, down), (op, dict(counter.calls))
