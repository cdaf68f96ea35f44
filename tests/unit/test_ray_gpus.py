"""How many GPUs each Ray actor asks for (no Ray needed: the rule is plain arithmetic)."""

import pytest

from jetflow.run.ray_placement import gpus_per_actor


def test_cpu_actors_ask_for_no_gpu():
    assert gpus_per_actor("cpu", 2, 2, cluster_gpus=8) == 0


@pytest.mark.parametrize("trainers, engines, gpus, share", [(2, 2, 4, 1.0), (4, 4, 16, 1.0), (1, 1, 1, 0.5),
                                                            (1, 3, 2, 0.5)])
def test_cuda_actors_get_a_gpu_or_an_equal_share(trainers, engines, gpus, share):
    assert gpus_per_actor("cuda", trainers, engines, cluster_gpus=gpus) == share


@pytest.mark.parametrize("trainers, engines, gpus", [(2, 2, 2), (1, 1, 0)])
def test_trainers_never_share_a_gpu(trainers, engines, gpus):
    with pytest.raises(RuntimeError, match="GPUs"):
        gpus_per_actor("cuda:0", trainers, engines, cluster_gpus=gpus)
