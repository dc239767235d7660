"""FTRL through TorchRec's in-backward optimizer path (spec seed 000): the placeholder class
resolves to ``DynamicEmbOptimType.FTRL``, every knob survives TorchRec's kwargs plumbing into the
table, and the planner's state multiplier is 2 where TorchRec's default is 1."""

from __future__ import annotations

import demb_optim
import pytest
import torch
import torchrec.optim as trec_optim
from demb_torchrec import (
    FTRL,
    DynamicEmbeddingTables,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from demb_torchrec.optimizers import (
    ftrl_spec,
    optimizer_multiplier,
    unregister_ftrl_emb_opt_type,
)
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.distributed.planner.shard_estimators import _get_optimizer_multipler
from torchrec.distributed.utils import (
    merge_fused_params,
    optimizer_type_to_emb_opt_type,
)
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

KNOBS = {
    "lr": 0.01,
    "learning_rate_power": -0.5,
    "ftrl_beta": 1.0,
    "l1_reg": 0.001,
    "l2_reg": 0.002,
    "initial_accumulator_value": 0.1,
    "gradient_clipping": True,
    "max_gradient": 2.0,
}
SPEC = demb_optim.FTRL(
    learning_rate=0.01,
    learning_rate_power=-0.5,
    ftrl_beta=1.0,
    l1_reg=0.001,
    l2_reg=0.002,
    initial_accumulator_value=0.1,
    gradient_clipping=True,
    max_gradient=2.0,
)


def test_ftrl_resolves_to_the_dynamic_type_once_constructed(registry):
    unregister_ftrl_emb_opt_type()
    with pytest.raises(ValueError, match="Cannot cast"):
        optimizer_type_to_emb_opt_type(FTRL)
    opt = FTRL([], **KNOBS)
    assert optimizer_type_to_emb_opt_type(FTRL) is DynamicEmbOptimType.FTRL
    assert opt.spec == SPEC
    with pytest.raises(NotImplementedError, match="applied by the dynamic table"):
        opt.step()


def test_unknown_or_doubled_knobs_are_refused(registry):
    with pytest.raises(TypeError, match="momentum: not hyper-parameters of ftrl"):
        FTRL([], lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="lr or learning_rate"):
        ftrl_spec({"lr": 0.1, "learning_rate": 0.2})
    with pytest.raises(ValueError, match="learning_rate_power"):
        FTRL([], lr=0.1, learning_rate_power=0.5)


def _fused_params(module: torch.nn.Module, explicit_type_on_ec: bool) -> dict:
    """A table's fused params the way TorchRec's sharders build them from in-backward
    optimizer kwargs (embedding.py names the type unconditionally; embeddingbag.py only when
    the kwargs do not)."""
    param = next(module.parameters())
    assert param._optimizer_classes == [FTRL]
    kwargs = dict(param._optimizer_kwargs[0])
    if explicit_type_on_ec or "optimizer" not in kwargs:
        kwargs["optimizer"] = optimizer_type_to_emb_opt_type(param._optimizer_classes[0])
    return merge_fused_params({}, kwargs)


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_every_knob_reaches_the_table_on_both_collection_paths(registry, kind):
    if kind == "ec":
        config = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])
        collection: torch.nn.Module = EmbeddingCollection(tables=[config])
        mode = DynamicEmbPoolingMode.NONE
    else:
        config = EmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"]
        )
        collection = EmbeddingBagCollection(tables=[config])
        mode = DynamicEmbPoolingMode.SUM
    unregister_ftrl_emb_opt_type()
    apply_optimizer_in_backward(FTRL, collection.parameters(), dict(KNOBS))
    fused = _fused_params(collection, explicit_type_on_ec=kind == "ec")
    optimizer = fused.pop("optimizer")
    assert optimizer is DynamicEmbOptimType.FTRL
    module = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=4, max_capacity=128)],
        pooling_mode=mode,
        device="cpu",
        optimizer=optimizer,
        **fused,
    )
    assert module.optimizer == SPEC
    module(torch.tensor([7]), torch.tensor([0, 1]))  # inserts key 7: its state is the initial
    rows = module.tables.export(0).values
    assert rows.shape == (1, 12)  # [embedding 4 | linear 4 | accum 4]
    assert torch.equal(rows[0, 4:8], torch.zeros(4))
    torch.testing.assert_close(rows[0, 8:], torch.full((4,), 0.1))


def test_state_multiplier_is_two_for_ftrl_and_torchrecs_elsewhere():
    shape = torch.Size([1000, 64])
    assert optimizer_multiplier(FTRL, shape) == 2.0
    assert _get_optimizer_multipler(FTRL, shape) == 1  # what the wrapper corrects
    for cls in (trec_optim.SGD, trec_optim.Adam, trec_optim.RowWiseAdagrad, trec_optim.Adagrad):
        assert optimizer_multiplier(cls, shape) == _get_optimizer_multipler(cls, shape)
    assert optimizer_multiplier(trec_optim.Adam, shape) == 2
    assert optimizer_multiplier(trec_optim.RowWiseAdagrad, shape) == 1 / 64
    assert optimizer_multiplier(None, shape) == 0.0
