"""shuffled_batches: Base Batch Shuffling plans of the train split, one per world size."""

import dagster as dg
from pydantic import Field

from assets.metadata_values import metadata_value
from assets.partitions import daily_partitions
from assets.resources import LakeResource, MLflowResource
from assets.sequence_logs import sequence_logs, sequence_logs_path
from gem_ops.data.batch_shuffling import ShufflingConfig, imbalance, plan_base_batch_shuffling, plan_random, write_plan
from gem_ops.data.loader import SequenceLogs
from gem_ops.data.plots import balance_chart
from gem_ops.metadata_views import figure_markdown
from gem_ops.train.data_check import describe_labels


class ShuffledBatchesConfig(dg.Config):
    world_sizes: list[int] = Field([1, 2, 8], description="A plan is written for each training world size.")
    sub_batch_size: int = 128
    sub_batches_per_rank: int = 4
    cost: str = Field("attention", description="tokens (L+1), attention ((L+1)^2) or measured ((L+1)^2 + "
                      "tokens_per_pair x (L+1)) per sample")
    tokens_per_pair: float = Field(0.0, description="cost measured: the fitted weight of a token against an attention "
                                   "pair (an MFU report's step_cost.tokens_per_pair)")
    max_history_len: int | None = Field(
        None, description="Histories as the trainer will cut them; default: as stored. A model trained on other "
        "lengths re-balances the plan's examples for its own (gem_ops.train.batches).")
    seed: int = 0


def plan_path(lake: LakeResource, day: str, world_size: int):
    return lake.path("shuffled_batches", day, f"world_size={world_size}.parquet")


@dg.asset(partitions_def=daily_partitions, deps=[sequence_logs], group_name="data", kinds={"numpy", "parquet"})
def shuffled_batches(
    context: dg.AssetExecutionContext, config: ShuffledBatchesConfig, lake: LakeResource, mlflow: MLflowResource
):
    """Per-rank batch plans: length-sorted sub-batches, heaviest paired with lightest, step costs balanced."""
    logs = SequenceLogs(sequence_logs_path(lake, context.partition_key))
    train = logs.split_indices("train")
    history_cap = min(config.max_history_len or logs.max_history_len, logs.max_history_len)
    lengths = logs.history_lengths(history_cap)[train]
    shuffling = ShufflingConfig(config.sub_batch_size, config.sub_batches_per_rank, config.cost, config.seed,
                                config.tokens_per_pair)
    if train.size < shuffling.rank_batch_size:
        raise dg.Failure(description=(
            f"{logs.path}: {train.size} training examples ({describe_labels(logs, train)}) are fewer than one rank's "
            f"step ({config.sub_batch_size} x {config.sub_batches_per_rank}): nothing to plan; lower sub_batch_size or "
            "give sequence_logs more labelled days"))
    figures, metadata = {}, {}
    with lake.partition_lock(context), mlflow.asset_run(context) as run:
        run.log_params(config.model_dump())
        for world_size in config.world_sizes:
            plan = plan_base_batch_shuffling(lengths, world_size, shuffling, train)
            baseline = imbalance(plan_random(lengths, world_size, shuffling, train))
            balanced = imbalance(plan)
            if plan.steps == 0:
                context.log.warning("world size %d: %d training examples are fewer than one step of %d ranks x %d; its "
                                    "plan has no step", world_size, train.size, world_size, shuffling.rank_batch_size)
            path = write_plan(plan, plan_path(lake, context.partition_key, world_size), history_cap)
            figures[world_size] = {"random": baseline["max_over_mean"], "bbs": balanced["max_over_mean"]}
            metadata[f"world_size={world_size}"] = dg.MetadataValue.json(
                {"path": str(path), "steps": plan.steps, "dropped": plan.dropped, "random": baseline, "bbs": balanced}
            )
            run.log_metrics(
                {f"ws{world_size}.imbalance_random": baseline["max_over_mean"],
                 f"ws{world_size}.imbalance_bbs": balanced["max_over_mean"],
                 f"ws{world_size}.worst_step_bbs": balanced["worst_step"],
                 f"ws{world_size}.steps": plan.steps, f"ws{world_size}.dropped": plan.dropped}
            )
        chart = balance_chart(figures)
        run.log_figure(chart, "balance.png")
        balance = metadata_value(figure_markdown(chart, "step imbalance, random against Base Batch Shuffling"))
        run.log_dict(figures, "balance.json")
    return dg.MaterializeResult(
        metadata={"dagster/row_count": len(train), "train_examples": len(train), **metadata,
                  "imbalance": dg.MetadataValue.json(figures), "balance_chart": balance}
    )
