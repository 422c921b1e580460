"""What pyproject.toml promises users who install the package."""

from __future__ import annotations

import os
import re
import tomllib

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")


def test_the_cuda_extra_brings_jaxs_cuda_build_at_the_supported_jax():
    project = tomllib.load(open(PYPROJECT, "rb"))["project"]
    jax = next(r for r in project["dependencies"] if re.match(r"jax\b(?!\[)", r))
    (cuda,) = project["optional-dependencies"]["cuda"]
    assert re.fullmatch(r"jax\[cuda12\](>=.*)", cuda) and cuda.removeprefix("jax[cuda12]") == jax.removeprefix("jax")
