"""Row-wise Adagrad on sparse table gradients: the same update as TorchRec's on the dense gradient,
touching only the rows a batch looked up; a model trained with sparse table gradients matches one
trained with dense ones; AdamW on the dense parameters is fused on a GPU and leaves biases and norms
undecayed."""

import pytest
import torch
from torch import nn
from torchrec.optim import RowWiseAdagrad

from gem_ops.model.config import model_config
from gem_ops.model.features import model_input
from gem_ops.train.config import TrainConfig
from gem_ops.train.model_state import seeded_model
from gem_ops.train.optimizer import SparseRowWiseAdagrad, build_optimizer, sparse_table_gradients
from tests.model_inputs import SPEC, random_batch


def _lookups(table: nn.Embedding, ids: torch.Tensor) -> None:
    (table(ids) * torch.arange(1.0, table.embedding_dim + 1)).sum().backward()


def test_sparse_update_equals_torchrecs_dense_update():
    torch.manual_seed(0)
    dense, sparse = nn.Embedding(50, 4), nn.Embedding(50, 4, sparse=True)
    sparse.weight.data.copy_(dense.weight.data)
    theirs = RowWiseAdagrad([dense.weight], lr=0.1, lr_decay=0.01)
    ours = SparseRowWiseAdagrad([sparse.weight], lr=0.1, lr_decay=0.01)
    for ids in ([3, 7, 7, 49], [0, 3], [12, 12, 12, 3]):  # repeated rows add up, as in the dense gradient
        for table, optimizer in ((dense, theirs), (sparse, ours)):
            optimizer.zero_grad()
            _lookups(table, torch.tensor(ids))
            optimizer.step()
        assert sparse.weight.grad.is_sparse
        torch.testing.assert_close(sparse.weight, dense.weight)
        torch.testing.assert_close(ours.state[sparse.weight]["sum"], theirs.state[dense.weight]["sum"])
    assert set(ours.state_dict()["state"][0]) == set(theirs.state_dict()["state"][0])  # checkpoints interchange


def test_weight_decay_leaves_rows_no_batch_looked_up():
    table = nn.Embedding(10, 3, sparse=True)
    before = table.weight.detach().clone()
    optimizer = SparseRowWiseAdagrad([table.weight], lr=0.1, weight_decay=0.5)
    _lookups(table, torch.tensor([2, 5]))
    optimizer.step()
    changed = (table.weight != before).any(1)
    assert changed.nonzero().flatten().tolist() == [2, 5]


def test_model_trains_the_same_with_sparse_table_gradients(steps=3):
    config = model_config("vertical", **{"embedding.item_buckets": 512, "embedding.user_buckets": 256})
    x = model_input(random_batch([0, 3, 9, 1, 14]), SPEC, config)
    models = [seeded_model(SPEC, config) for _ in range(2)]
    names = sparse_table_gradients(models[1])
    assert names and all(m.sparse for n, m in models[1].named_modules() if n in names)
    # Dense parameters held still: AdamW normalises gradients that are exactly zero in theory (the key
    # projection's bias under softmax) but differ by rounding between the two runs into full steps.
    train = TrainConfig(lr_sparse=0.2, lr_dense=0.0)
    optimizers = [build_optimizer(model, train) for model in models]
    for _ in range(steps):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad(set_to_none=True)
            model.loss(x)[0].backward()
            optimizer.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert any((m.weight != seeded_model(SPEC, config).get_submodule(n).weight).any()
               for n, m in models[1].named_modules() if n in names)  # the tables did train


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    optimizer = build_optimizer(model, TrainConfig())
    (adamw,) = [o for _, o in optimizer.optimizers if isinstance(o._optimizer, torch.optim.AdamW)]
    return adamw._optimizer


def test_adamw_is_fused_on_a_gpu_only_and_skips_decay_on_biases_and_norms():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(10, 4))
    adamw = _adamw(model)
    assert adamw.defaults["fused"] is None  # CPU: PyTorch's default implementation
    decayed, not_decayed = adamw.param_groups
    assert [p.shape for p in decayed["params"]] == [(4, 4)] and decayed["weight_decay"] == 0.01
    assert len(not_decayed["params"]) == 3 and not_decayed["weight_decay"] == 0.0


def test_radam_when_asked_keeps_the_groups_and_decouples_their_decay():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(10, 4))
    optimizer = build_optimizer(model, TrainConfig(dense_optimizer="radam"))
    (radam,) = [o._optimizer for _, o in optimizer.optimizers if isinstance(o._optimizer, torch.optim.RAdam)]
    decayed, not_decayed = radam.param_groups
    assert [p.shape for p in decayed["params"]] == [(4, 4)] and decayed["weight_decay"] == 0.01
    assert len(not_decayed["params"]) == 3 and not_decayed["weight_decay"] == 0.0
    assert radam.defaults["decoupled_weight_decay"] is True
    with pytest.raises(ValueError, match="dense_optimizer must be one of"):
        TrainConfig(dense_optimizer="sgd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adamw_is_fused_on_a_gpu():
    assert _adamw(nn.Sequential(nn.Linear(4, 4)).cuda()).defaults["fused"] is True
