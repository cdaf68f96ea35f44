"""A Ray trainer worker lost under the run ends it in one line naming what to do (jetflow.run.ray_placement
.trainer_results), whether it died or Ray's memory monitor killed it; a fake `ray` module stands in for Ray."""

from __future__ import annotations

import types

import pytest

from jetflow.run.ray_placement import trainer_results
from jetflow.run.stop import RunFault


class RayActorError(Exception):
    pass


class OutOfMemoryError(Exception):  # Ray's is a RayError, not a RayActorError
    pass


def _ray_raising(error: Exception):
    def get(futures):
        raise error
    return types.SimpleNamespace(get=get, exceptions=types.SimpleNamespace(RayActorError=RayActorError,
                                                                          OutOfMemoryError=OutOfMemoryError))


@pytest.mark.parametrize("error, says", [
    (OutOfMemoryError("3 worker(s) were killed due to the node running low on memory.\nTop 10 memory users"),
     "Ray killed a trainer worker for memory during step 2 (3 worker(s) were killed due to the node running low on "
     "memory.); the memory savers' `auto` is not resolved under Ray: set train.activation_checkpointing=true"),
    (RayActorError("The actor died unexpectedly\ndetails"), "a Ray trainer worker died during step 2 (The actor died "
     "unexpectedly); its checkpoints are intact: the same command with run.resume=true continues it"),
])
def test_a_lost_trainer_worker_is_one_line(error, says):
    with pytest.raises(RunFault) as e:
        trainer_results(_ray_raising(error), [], "during step 2")
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
