"""torch's OpenMP spin is shortened before torch loads, and a user's own choice is kept."""

import os
import subprocess
import sys

import pytest


def _spin_after(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    result = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True,
                            text=True, check=True, timeout=120)
    return result.stdout.strip()


def test_importing_nanoserve_first_shortens_the_spin():
    from nanoserve import openmp

    assert _spin_after("import nanoserve, os; print(os.environ.get('GOMP_SPINCOUNT'))") == openmp.SPIN_COUNT
    assert _spin_after("import nanoserve.openmp as o; print(o.note())") == "None"


@pytest.mark.parametrize("variable, value", [("GOMP_SPINCOUNT", "5"), ("OMP_WAIT_POLICY", "ACTIVE")])
def test_a_users_own_openmp_setting_is_kept(variable, value):
    code = "import nanoserve, os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    spin, policy = _spin_after(code, **{variable: value}).split()
    assert (spin if variable == "GOMP_SPINCOUNT" else policy) == value
    if variable == "OMP_WAIT_POLICY":
        assert spin == "None"


def test_torch_loaded_first_is_said_at_start_up():
    code = ("import torch, nanoserve, os; from nanoserve import openmp; "
            "print(os.environ.get('GOMP_SPINCOUNT')); print(openmp.note())")
    spin, note = _spin_after(code).split("\n", 1)
    assert spin == "None"
    assert "GOMP_SPINCOUNT" in note and "imported before nanoserve" in note


def test_another_programs_environment_leaves_out_our_spin_but_keeps_a_users():
    code = ("import nanoserve, os; from nanoserve import openmp; "
            "print(openmp.foreign_environment().get('GOMP_SPINCOUNT'))")
    assert _spin_after(code) == "None"  # llama.cpp's OpenMP barriers keep their own default
    assert _spin_after(code, GOMP_SPINCOUNT="7") == "7"
