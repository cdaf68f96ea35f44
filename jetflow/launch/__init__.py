"""`jetflow launch slurm`: a SLURM batch script for `jetflow train`, rendered from the templates that ship
inside the package (templates/: torchrun.sbatch, ray.sbatch, requeue.sh, torchrun.sh), so an installed
jetflow renders and submits it as a source checkout does. See jetflow.launch.slurm."""

from jetflow.launch.slurm import KINDS, TEMPLATES, SubmitError, render_slurm, submit

__all__ = ["KINDS", "TEMPLATES", "SubmitError", "render_slurm", "submit"]
