"""Weight updates to the engine's process through shared memory (jetflow.run.shared_calls, issue 72): the engine
loads exactly the trainer's tensors as they were when the update was sent (a snapshot, whatever the trainer does
afterwards), verifies them as every sync is, and no shared memory or descriptor outlives the calls, the engine's
death or the trainer's."""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import time

import pytest
import torch

from jetflow.run import shared_calls
from orphans import assert_engine_dies_with_its_killed_parent

# an engine built as a run builds it, with two methods for the tests: `weights` (its weights, read back as the
# trainer's update reads the trainer's) and `sleep` (a long call the next ones queue behind)
ENGINE_MODULE = '''
import time
from jetflow.run.sides import standalone_engine
from jetflow.sync import build_update

class Probed:
    def __init__(self, engine, mode, fingerprint):
        self.engine, self.mode, self.fingerprint = engine, mode, fingerprint
    def load_weights(self, update):
        self.engine.load_weights(update)
    def weights(self):
        update = build_update(self.engine.model, self.mode, self.engine.weight_version, self.fingerprint)
        return {**{k: v.clone() for k, v in update.tensors.items()},
                **{k + ".bytes": q.data.view(__import__("torch").uint8).clone() for k, q in update.quantized.items()},
                **{k + ".scale_inv": q.scale_inv.clone() for k, q in update.quantized.items()}}
    def sleep(self, seconds):
        time.sleep(seconds)

def build(cfg, derived):
    return Probed(standalone_engine(cfg, derived), derived.precision.mode.value, derived.precision.fingerprint)
'''


def _flat(update) -> dict[str, torch.Tensor]:
    """An update's tensors under the names `Probed.weights` gives them."""
    return {**update.tensors, **{k + ".bytes": q.data.view(torch.uint8) for k, q in update.quantized.items()},
            **{k + ".scale_inv": q.scale_inv for k, q in update.quantized.items()}}


def _open_fds() -> set[str]:
    """This process's descriptors of sockets (the engine's pipe) and shared files."""
    targets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own
            continue
        if target.startswith(("socket:", "/memfd:", "/dev/shm")):
            targets.add(f"{fd} {target}")
    return targets


def _shared_files() -> list[str]:
    """This process's mappings of shared-memory files."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:" in line or "/dev/shm" in line]


def _trainer(tmp_path, mode: str):
    from jetflow.config import derive, load_config
    from jetflow.run.build import load_inputs
    from jetflow.run.sides import TrainerSide
    cfg = load_config("configs/tiny.yaml", [f"precision.mode={mode}", "run.num_threads=1", f"run.out_dir={tmp_path}",
                                            "run.loggers=[]"])
    derived = derive(cfg)
    return cfg, derived, TrainerSide(cfg, derived, load_inputs(cfg)).trainer


@pytest.fixture
def probed(tmp_path, monkeypatch):
    (tmp_path / "probed_engine.py").write_text(ENGINE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned child starts from this process's sys.path


@pytest.mark.parametrize("mode", ["unified", "bf16"])
def test_the_engine_loads_the_trainers_weights_as_they_were_sent(tmp_path, probed, mode):
    """The update waits in the queue behind a long call while the trainer changes every weight in place (its
    parameters and its FP8 bytes): the engine loads the weights of the moment it was sent, bit for bit."""
    from jetflow.run.engine_process import ProcessRollout
    from probed_engine import build

    cfg, derived, trainer = _trainer(tmp_path, mode)
    trainer.version = 1
    update = trainer.weight_update(mode, derived.precision.fingerprint)
    sent = {k: v.clone() for k, v in _flat(update).items()}  # the reference: an independent copy
    engine = ProcessRollout(build, cfg, derived, 1)
    try:
        engine.process.send("sleep", 1.0)
        engine.load_weights(update)
        with torch.no_grad():  # the trainer trains on: every tensor the update holds changes under it
            for t in _flat(update).values():
                t.view(torch.uint8).add_(1)
        assert not any(torch.equal(_flat(update)[k], sent[k]) for k in sent if sent[k].numel())
        loaded, _ = engine.process.reply(engine.process.send("weights"))
    finally:
        engine.close()
    assert sorted(loaded) == sorted(sent) and len(sent) > 10
    for name, tensor in sent.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_the_engine_verifies_an_update_that_came_through_shared_memory(tmp_path, probed):
    from jetflow.run.engine_process import EngineProcessError, ProcessRollout
    from jetflow.sync import build_update
    from probed_engine import build

    cfg, derived, trainer = _trainer(tmp_path, "unified")
    engine = ProcessRollout(build, cfg, derived, 1)
    try:
        damaged = build_update(trainer.model, "unified", 1, derived.precision.fingerprint, with_checksum=True)
        next(iter(damaged.tensors.values())).view(torch.uint8)[0] += 1  # after the checksum: damage in transit
        engine.load_weights(damaged)
        with pytest.raises(EngineProcessError, match="CorruptWeightsError: weight update v1: checksum mismatch"):
            engine.process.reply(engine.process.send("weights"))
        other = build_update(trainer.model, "unified", 1, "another-recipe", with_checksum=True)
        engine.load_weights(other)
        with pytest.raises(EngineProcessError, match="another-recipe"):
            engine.process.reply(engine.process.send("weights"))
        good = build_update(trainer.model, "unified", 2, derived.precision.fingerprint, with_checksum=True)
        engine.load_weights(good)
        stale = build_update(trainer.model, "unified", 2, derived.precision.fingerprint, with_checksum=True)
        engine.load_weights(stale)
        with pytest.raises(EngineProcessError, match="StaleWeightsError: weight update version 2 is not newer"):
            engine.process.reply(engine.process.send("weights"))
    finally:
        engine.close()


def test_no_shared_memory_outlives_the_calls_or_a_killed_engine(tmp_path, probed):
    """Updates sent, loaded, and queued behind a long call when the engine is killed: afterwards this process holds
    no descriptor or mapping of a shared file it did not hold before, and /dev/shm has no new entry."""
    from jetflow.run.engine_process import EngineProcessDied, ProcessRollout
    from probed_engine import build

    cfg, derived, trainer = _trainer(tmp_path, "unified")
    fds, shm, shared = _open_fds(), set(os.listdir("/dev/shm")), _shared_files()
    engine = ProcessRollout(build, cfg, derived, 1)
    engine_fds = _open_fds()  # the pipe and the sender's: closed by close()
    try:
        for version in (1, 2):
            trainer.version = version
            engine.load_weights(trainer.weight_update("unified", derived.precision.fingerprint))
        engine.process.reply(engine.process.send("weights"))  # both loaded
        assert _shared_files() == shared and _open_fds() == engine_fds  # sent: this process let go of them
        engine.process.send("sleep", 60.0)
        for version in (3, 4, 5):
            trainer.version = version
            engine.load_weights(trainer.weight_update("unified", derived.precision.fingerprint))
        time.sleep(0.5)
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied):
            engine.process.reply(engine.process.send("weights"))
    finally:
        engine.close()
    assert _open_fds() == fds and _shared_files() == shared and set(os.listdir("/dev/shm")) == shm


def test_no_shared_memory_outlives_a_killed_trainer(tmp_path, probed):
    """A trainer killed with updates queued for its engine: the engine dies with it, and /dev/shm keeps no file."""
    shm = set(os.listdir("/dev/shm"))
    script = (
        "import time, torch\n"
        "from jetflow.config import derive, load_config\n"
        "from jetflow.run.engine_process import ProcessRollout\n"
        "from jetflow.sync import WeightUpdate\n"
        "from probed_engine import build\n"
        "cfg = load_config('configs/tiny.yaml', ['run.loggers=[]'])\n"
        "engine = ProcessRollout(build, cfg, derive(cfg), 1)\n"
        "engine.process.send('sleep', 600.0)\n"
        "for v in (1, 2):\n"
        "    engine.load_weights(WeightUpdate(v, 'bf16', None, tensors={'w': torch.ones(1 << 20)}))\n"
        "print(engine.process.pid, flush=True)\n"
        "time.sleep(600)\n")
    assert_engine_dies_with_its_killed_parent(script, tmp_path)
    assert set(os.listdir("/dev/shm")) == shm


def test_a_calls_tensors_cross_as_they_were_when_it_was_packed():
    """Every dtype a weight update carries (FP8 bytes, bf16, fp32 scales, 0-d, empty, non-contiguous, one tensor
    twice), through a real pipe: equal to a copy taken at packing, with the originals changed since."""
    tensors = {"fp8": torch.randn(130, 70).to(torch.float8_e4m3fn), "bf16": torch.randn(3, 5).to(torch.bfloat16),
               "scale": torch.rand(2, 1), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
               "strided": torch.arange(24.0).reshape(4, 6).t(), "flag": torch.tensor([True, False]),
               "ids": torch.arange(5, dtype=torch.int64)}
    call = ("load", (tensors, tensors["bf16"]), {"version": 3})
    reference = copy.deepcopy(call)
    message, fd = shared_calls.pack(call)
    for t in tensors.values():  # changed in place (a 0-d tensor viewed as 1-d first)
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_contiguous():
            t.reshape(-1).view(torch.uint8).add_(1)
        else:
            t.add_(1)
    parent, child = multiprocessing.Pipe()
    try:
        shared_calls.send(parent, message, fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed once sent
        method, (got, again), kwargs = shared_calls.receive(child)
    finally:
        parent.close()
        child.close()
    assert (method, kwargs) == ("load", {"version": 3}) and again.data_ptr() == got["bf16"].data_ptr()
    for name, t in reference[1][0].items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
