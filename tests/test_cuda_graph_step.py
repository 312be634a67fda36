"""GEM's training step after the embedding lookups (what TrainConfig.compile="model" compiles), captured whole in
one CUDA graph with the Triton attention, forward and backward: replays on new values copied into the captured
inputs give the eager step's loss and every gradient. No host work is left on that path (no size read back, no
tile table built on the host), so a step of fixed shapes costs one launch."""

import copy

import pytest
import torch

from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from gem_ops.model.heads import loss_from_sums
from gem_ops.train.model_state import seeded_model
from tests.model_inputs import SPEC, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _step(model, x, embedded) -> torch.Tensor:
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):  # no cached casts across a capture
        sums = model.dense_loss_sums(x, *embedded)
    loss = loss_from_sums(sums)[0]
    loss.backward()
    return loss.detach()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / (want.float().norm() + 1e-6))


def test_gems_step_after_the_lookups_replays_from_one_cuda_graph():
    config = model_config("gem", width=0.5, blocks=2,
                          **{"embedding.item_buckets": 1024, "embedding.user_buckets": 1024})
    model = seeded_model(SPEC, config).cuda()
    eager = copy.deepcopy(model)
    x = model_input(random_batch([3, 1, 40, 9, 70, 0, 12, 5, 33, 2], seed=0), SPEC, config,
                    with_level_sizes=True).to("cuda")
    with torch.no_grad():
        static = [t.detach().clone().requires_grad_() for t in model.embeddings(x)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the kernels' autotuning and the allocator's warm-up, before capture
        for _ in range(2):
            _step(model, x, static)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = _step(model, x, static)
    captured = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    captured.update({f"input {i}": t.grad for i, t in enumerate(static)})

    losses = []
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for t in static:
                t.copy_(torch.randn(t.shape, generator=g, device="cuda") * t.std())
            x.labels.copy_(torch.randint(0, 2, x.labels.shape, generator=g, device="cuda").float())
        graph.replay()
        losses.append(float(captured_loss))

        inputs = [t.detach().clone().requires_grad_() for t in static]
        eager.zero_grad(set_to_none=True)
        want_loss = _step(eager, x, inputs)
        want = {name: p.grad for name, p in eager.named_parameters() if p.grad is not None}
        want.update({f"input {i}": t.grad for i, t in enumerate(inputs)})
        assert abs(losses[-1] - float(want_loss)) <= 1e-3 * abs(float(want_loss)) + 1e-4, (losses[-1], float(want_loss))
        assert captured.keys() == want.keys()
        for name in want:
            # equal up to the order of the attention backward's atomic additions and bf16 rounding
            assert _relative_error(captured[name], want[name]) < 2e-2, f"{name} after replay {seed}"
    assert losses[0] != losses[1]  # each replay computed its own batch


def test_the_engine_replays_its_compiled_step_from_cuda_graphs(tmp_path):
    """TrainConfig.cuda_graphs: the engine's compiled step ("reduce-overhead") trains what the compiled step without
    graphs trains, on exact and on bucketed sizes (size_bucket), every graph Inductor was asked for recorded (no
    skip), the step's start marked each step and each warm-up pass (warm_up_lengths, as MFU windows run)."""
    import dataclasses

    from torch._dynamo.utils import counters

    from gem_ops.model.config import FeatureSpec
    from gem_ops.train.config import TrainConfig
    from gem_ops.train.engine import train
    from tests.training_data import learnable_data

    data = learnable_data(tmp_path, days=4, eval_days=1, max_history_len=32, sub_batch_size=16, n_users=300)
    logs = data.open()
    config = model_config("vertical", width=0.5, **{"sequence.max_history_len": 32})  # two warm-up passes
    base = TrainConfig(max_steps=6, eval_max_examples=64, log_every=2, warmup_steps=2, compile="model",
                       precision="bf16")
    counters.clear()
    graphs = train(logs, data.plans[1], config, dataclasses.replace(base, cuda_graphs=True), device="cuda",
                   model=seeded_model(FeatureSpec.from_logs(logs), config))[1]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()
    bucketed = train(logs, data.plans[1], config, dataclasses.replace(base, cuda_graphs=True, size_bucket=1.5,
                                                                     warm_up_lengths=True),
                     device="cuda", model=seeded_model(FeatureSpec.from_logs(logs), config))[1]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()
    plain = train(logs, data.plans[1], config, base, device="cuda",
                  model=seeded_model(FeatureSpec.from_logs(logs), config))[1]
    assert graphs.losses == pytest.approx(plain.losses, rel=2e-3)
    assert graphs.cuda_graph_skips == bucketed.cuda_graph_skips == 0  # what the run itself reports
    assert bucketed.losses == pytest.approx(plain.losses, rel=2e-3)  # padded to bucketed sizes, replayed
