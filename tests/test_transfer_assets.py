"""The transfer assets on top of two days of gem_foundation_model (the session fixture): teacher_predictions
with a one-day-stale GEM, domain_foundation_models, and vertical_models twice: a first challenger per
(domain, objective) becomes champion; a second one that does not beat it by the required margin is kept
out by the blocking check and the champion stays."""

import dagster as dg
import mlflow.pyfunc
import numpy as np
import pytest

from assets.domain_foundation_models import domain_foundation_models
from assets.teacher_predictions import teacher_predictions
from assets.vertical_models import CHECK, vertical_models
from gem_ops.data.loader import SequenceLogs
from gem_ops.model.config import FeatureSpec
from gem_ops.train.mlflow_model import TEACHER_REPRESENTATION, batch_to_frame
from gem_ops.transfer.knowledge import read_predictions
from gem_ops.transfer.registry import CHALLENGER, CHAMPION, current_version
from tests.gem_asset_setup import DAYS, MODEL_NAME

STUDENT = {"max_steps": 8, "eval_max_examples": 256, "sub_batch_size": 32, "sub_batches_per_rank": 1,
           "model_overrides": {"sequence.max_history_len": "16"}}
DOMAINS = ["feed", "search"]


@pytest.fixture(scope="module")
def transferred(gem_asset_runs):
    day = DAYS[3].isoformat()
    common = {"resources": gem_asset_runs["resources"], "instance": gem_asset_runs["instance"], "partition_key": day}
    config = {
        "teacher_predictions": {"config": {"registered_model_name": MODEL_NAME, "staleness_days": 1,
                                           "student_days": 2}},
        "domain_foundation_models": {"config": {**STUDENT, "preset": "domain_fm", "width": 0.5, "domains": DOMAINS}},
        "vertical_models": {"config": {**STUDENT, "domains": DOMAINS, "mode": "hierarchical", "min_positives": 1}},
    }
    first = dg.materialize([teacher_predictions, domain_foundation_models, vertical_models],
                           run_config={"ops": config}, **common)
    # A second retraining that has to beat each champion's NE by 1.0 (impossible): every challenger is kept out.
    demanding = {**config["vertical_models"]["config"], "ne_tolerance": -1.0}
    second = dg.materialize([vertical_models], run_config={"ops": {"vertical_models": {"config": demanding}}},
                            raise_on_error=False, selection=[vertical_models], **common)
    return {**gem_asset_runs, "first": first, "second": second, "day": day}


def _materialization(result, key):
    return {m.asset_key.to_user_string(): m for m in result.get_asset_materialization_events()}[key].materialization


def _check(result):
    return [e.event_specific_data for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"]


def test_teacher_predictions_come_from_the_stale_gem(transferred):
    meta = _materialization(transferred["first"], "teacher_predictions").metadata
    client = transferred["client"]
    versions = {str(v.version): client.get_run(v.run_id).data.tags["dagster.partition_key"]
                for v in client.search_model_versions(f"name='{MODEL_NAME}'")}
    assert meta["teacher_partition"].value == DAYS[2].isoformat()  # one day stale
    assert versions[str(meta["teacher_version"].value)] == DAYS[2].isoformat()
    predictions = read_predictions(transferred["root"] / "lake" / "teacher_predictions"
                                   / f"{transferred['day']}.parquet")
    assert predictions.teacher["version"] == str(meta["teacher_version"].value)
    logs = SequenceLogs(transferred["root"] / "lake" / "sequence_logs" / transferred["day"])
    assert set(logs.split_indices("eval")) <= set(predictions.example_index)
    run = client.get_run(meta["mlflow_run_id"].value)
    assert run.data.tags["teacher.model_version"] == str(meta["teacher_version"].value)
    assert "teacher_predictions" in {a.path for a in client.list_artifacts(run.info.run_id)}
    gem_tags = client.get_model_version(MODEL_NAME, str(meta["teacher_version"].value)).tags
    assert gem_tags[f"teacher_predictions.{transferred['day']}"] == run.info.run_id


def test_domain_models_and_verticals_carry_their_lineage(transferred):
    client = transferred["client"]
    fm_meta = _materialization(transferred["first"], "domain_foundation_models").metadata
    fms = fm_meta["models"].value
    assert set(fms) == set(DOMAINS)
    # Each FM's eval figures, read as a table on the run page.
    rows = [r.data for r in fm_meta["quality"].value.records]
    assert {r["model"] for r in rows} == {f"domain_fm_{d} v{fms[d]['version']}" for d in DOMAINS}
    assert (all(0 <= r["auc"] <= 1 for r in rows if r["auc"] is not None)
            and any(r["group"] == "all/click" for r in rows))
    gem_version = str(_materialization(transferred["first"], "teacher_predictions").metadata["teacher_version"].value)
    for domain in DOMAINS:
        fm = client.get_model_version(f"domain_fm_{domain}", fms[domain]["version"])
        assert fm.tags["teacher.model_name"] == MODEL_NAME and fm.tags["teacher.model_version"] == gem_version
        # The teacher gate: the FM teaches its verticals only where it ranks its held-out day better than GEM.
        gate = fms[domain]["held_out_day"]
        assert fms[domain]["verticals_learn_from"] == gate["teacher"] == (
            "domain_fm" if gate["fm_auc"] > gate["gem_auc"] else "gem")
        assert gate["held_out_examples"] > 0
        assert client.get_run(fm.run_id).data.tags["verticals_learn_from"] == gate["teacher"]
        # The weight the FM trained at, as its run records it: the teacher's targets weigh as much as the labels.
        assert client.get_run(fm.run_id).data.params["model.distillation_weight"] == "1.0"
    verticals = _materialization(transferred["first"], "vertical_models").metadata["models"].value
    assert "vertical_feed_click" in verticals and "vertical_search_click" in verticals
    for name, entry in verticals.items():
        tags = client.get_model_version(name, entry["version"]).tags
        domain = name.split("_")[1]
        assert tags["transfer.mode"] == "hierarchical"
        if fms[domain]["verticals_learn_from"] == "domain_fm":
            assert tags["teacher.model_name"] == f"domain_fm_{domain}"
            assert (tags["teacher.teacher.model_name"] == MODEL_NAME
                    and tags["teacher.teacher.model_version"] == gem_version)
        else:  # the predictions its verticals read are GEM's own
            assert tags["teacher.model_name"] == MODEL_NAME and tags["teacher.model_version"] == gem_version
        assert entry["promoted"] and tags["promotion.decision"] == "promoted"
        # A vertical weighs its teacher's targets 4 times its labels by default, and its run says so.
        assert client.get_run(client.get_model_version(name, entry["version"]).run_id).data.params[
            "model.distillation_weight"] == "4.0"
        assert entry["shared_tables"] in ("fixed", "trained")  # "auto": both trained, the better on validation kept
        # One evaluation everywhere: the figures reported are the ones the promotion judged, with their count.
        assert entry["eval_examples"] == int(tags["promotion.examples"])
        assert entry["vertical.auc"] == pytest.approx(float(tags["promotion.challenger_auc"]), abs=1e-3)
        assert entry["vertical.ne"] == pytest.approx(float(tags["promotion.challenger_ne"]), abs=1e-3)


def test_first_challengers_become_champions_and_later_ones_not_good_enough_are_kept_out(transferred):
    client = transferred["client"]
    first_check, = _check(transferred["first"])
    assert first_check.check_name == CHECK and first_check.passed
    second_check, = _check(transferred["second"])
    assert not second_check.passed and second_check.severity == dg.AssetCheckSeverity.ERROR
    second = _materialization(transferred["second"], "vertical_models").metadata["models"].value
    first = _materialization(transferred["first"], "vertical_models").metadata["models"].value
    kept_out = second_check.metadata["kept_out"].value
    assert sorted(kept_out) == sorted(first), second
    for name in kept_out:
        assert current_version(client, name, CHAMPION) == first[name]["version"]
        assert current_version(client, name, CHALLENGER) == second[name]["version"]
        tags = client.get_model_version(name, second[name]["version"]).tags
        assert tags["promotion.decision"] == "kept_out"
        assert float(tags["promotion.challenger_ne"]) > float(tags["promotion.champion_ne"]) - 1.0
        # The asset's default allowance of standard errors reaches the decision.
        assert "(tolerance -1 + 1.645 standard errors)" in tags["promotion.reason"], tags["promotion.reason"]
        assert tags["promotion.champion_version"] == str(first[name]["version"])


def test_a_domain_too_small_to_train_is_skipped_and_the_others_train(transferred):
    """A domain with fewer fresh examples than one batch is skipped by both assets, with the counts in the
    log and the metadata; the other domain's FM and verticals train as before."""
    from gem_ops.transfer.config import TransferWindows
    from gem_ops.transfer.hierarchy import DomainData

    logs = SequenceLogs(transferred["root"] / "lake" / "sequence_logs" / transferred["day"])
    window = TransferWindows(student_days=2)
    sizes = {d: DomainData.of(logs, d, window).train.size for d in DOMAINS}
    small, large = sorted(DOMAINS, key=sizes.get)
    assert sizes[small] < sizes[large]
    sized = {**STUDENT, "sub_batch_size": int(sizes[small]) + 1, "max_steps": 2}
    # With the teacher gate off, the FM teaches its verticals whatever it scores.
    config = {"domain_foundation_models": {"config": {**sized, "preset": "domain_fm", "width": 0.5, "domains": DOMAINS,
                                                      "teacher_gate": False}},
              # Two steps against the first run's champions: promotion is not what this test is about.
              "vertical_models": {"config": {**sized, "domains": DOMAINS, "mode": "hierarchical", "min_positives": 1,
                                             "ne_tolerance": 1.0}}}
    result = dg.materialize([domain_foundation_models, vertical_models], run_config={"ops": config},
                            resources=transferred["resources"], instance=transferred["instance"],
                            partition_key=transferred["day"], selection=[domain_foundation_models, vertical_models])
    assert result.success
    why = f"domain '{small}': {sizes[small]} training examples in the student window are fewer than one batch"
    for key in ("domain_foundation_models", "vertical_models"):
        meta = _materialization(result, key).metadata
        skipped = meta["skipped"].value  # domains, and (vertical_models) objectives too few positives left out
        assert [k for k in skipped if "/" not in k] == [small] and skipped[small].startswith(why)
        assert all(k.startswith(f"{large}/") and "min_positives" in v for k, v in skipped.items() if "/" in k)
    fms = _materialization(result, "domain_foundation_models").metadata["models"].value
    assert set(fms) == {large} and "verticals_learn_from" not in fms[large]
    trained = _materialization(result, "vertical_models").metadata["models"].value
    assert trained and all(f"_{large}_" in name for name in trained)
    for name, entry in trained.items():
        tags = transferred["client"].get_model_version(name, entry["version"]).tags
        assert tags["teacher.model_name"] == f"domain_fm_{large}" and tags["teacher.teacher.model_name"] == MODEL_NAME


def test_a_day_with_a_single_labelled_event_skips_every_student_with_its_counts(transferred, tmp_path):
    """A day whose log holds one labelled event (read through the parquet source) passes the data assets;
    the transfer assets succeed without training a model, each domain skipped with its counts named."""
    import polars as pl

    from assets.raw_event_logs import raw_event_logs
    from assets.sequence_logs import sequence_logs
    from gem_ops.data.synthetic import SyntheticConfig, generate_day
    from tests.gem_asset_setup import DATA_CONFIG

    day = DAYS[3] + (DAYS[1] - DAYS[0])
    events = generate_day(SyntheticConfig(n_users=300), day).with_row_index("row")
    first = int(events.filter(pl.col("label_click").is_not_null())["row"][0])
    thin = events.with_columns(
        [pl.when(pl.col("row") == first).then(pl.col(c)).otherwise(None).alias(c)
         for c in ("label_click", "label_conversion")]).drop("row")
    thin.write_parquet(tmp_path / f"{day}.parquet")
    config = {
        "raw_event_logs": {"config": {"source": "parquet", "parquet_template": str(tmp_path / "{date}.parquet")}},
        "sequence_logs": DATA_CONFIG["sequence_logs"],
        "teacher_predictions": {"config": {"registered_model_name": MODEL_NAME, "staleness_days": 1,
                                           "student_days": 2}},
        "domain_foundation_models": {"config": {**STUDENT, "preset": "domain_fm", "width": 0.5}},
        "vertical_models": {"config": {**STUDENT, "mode": "hierarchical", "min_positives": 1}},
    }
    common = {"resources": transferred["resources"], "instance": transferred["instance"],
              "partition_key": day.isoformat()}
    data = ("raw_event_logs", "sequence_logs")
    assert dg.materialize([raw_event_logs, sequence_logs], run_config={"ops": {k: config[k] for k in data}},
                          **common).success
    result = dg.materialize([teacher_predictions, domain_foundation_models, vertical_models],
                            run_config={"ops": {k: v for k, v in config.items() if k not in data}}, **common)
    assert result.success
    logs = SequenceLogs(transferred["root"] / "lake" / "sequence_logs" / day.isoformat())
    assert logs.split_indices("eval").size == 1
    for key in ("domain_foundation_models", "vertical_models"):
        meta = _materialization(result, key).metadata
        assert meta["models"].value == {}
        skipped = meta["skipped"].value
        assert set(skipped) == set(logs.surfaces), skipped
        labelled_domain = logs.surfaces[int(logs.column("surface")[logs.split_indices("eval")][0])]
        assert "no objective has both positives and negatives" in skipped[labelled_domain]
        assert "1 eval examples (click: 1 labelled" in skipped[labelled_domain], skipped[labelled_domain]
        assert all(reason == f"domain {d!r}: no eval examples" for d, reason in skipped.items() if d != labelled_domain)


def test_a_vertical_with_representation_transfer_serves_without_its_teachers(transferred, tmp_path):
    """The registered vertical reads its teacher's user representation as a looked-up request column: with
    every teacher's registered package deleted, it still serves through mlflow.pyfunc, and its predictions
    equal the registry's scoring of it, which also looks the vectors up instead of running a teacher."""
    import shutil
    from urllib.parse import urlparse

    from gem_ops.transfer.registry import TEACHER_REPRESENTATIONS, score_version
    from gem_ops.transfer.user_representations import read_user_representations, representations_of_examples

    client = transferred["client"]
    name = "vertical_feed_click"
    version = current_version(client, name, CHAMPION)
    tags = client.get_model_version(name, version).tags
    # its teacher and that one's teacher: the domain FM and GEM, or GEM alone where the teacher gate kept it
    teachers = [(tags[f"{p}model_name"], tags[f"{p}model_version"]) for p in ("teacher.", "teacher.teacher.")
                if f"{p}model_name" in tags]
    assert MODEL_NAME in {name for name, _ in teachers}
    for teacher, teacher_version in teachers:  # gone
        shutil.rmtree(urlparse(client.get_model_version(teacher, teacher_version).source).path)

    mlflow.set_tracking_uri(transferred["uri"])
    model = mlflow.pyfunc.load_model(f"models:/{name}/{version}")
    assert TEACHER_REPRESENTATION in model.input_example.columns
    logs = SequenceLogs(transferred["root"] / "lake" / "sequence_logs" / transferred["day"])
    feed = list(logs.surfaces).index("feed")
    rows = np.flatnonzero((logs.column("surface") == feed) & (logs.column("split") == 1))[:20]
    batch = logs.batch(rows, 16)
    frame = batch_to_frame(batch, FeatureSpec.from_logs(logs))
    with pytest.raises(Exception, match="teacher.representation"):
        model.predict(frame)  # the vector is an input: a request must carry it
    table = read_user_representations(tags[TEACHER_REPRESENTATIONS])
    frame[TEACHER_REPRESENTATION] = representations_of_examples(table, logs, rows).astype(np.float32).tolist()
    served = model.predict(frame)["p_click"].to_numpy()
    _, scored = score_version(client, name, version, logs, rows)
    order = np.argsort(scored.example_index)
    np.testing.assert_allclose(served, 1 / (1 + np.exp(-scored.logits[order, 0])), rtol=1e-4, atol=1e-6)
    assert np.all((served > 0) & (served < 1))



def test_serving_models_measures_each_champion_and_refuses_one_slower_than_the_budget(transferred):
    """serving_models after vertical_models, on one vertical: its champion gets a serving artifact and measured
    latency figures (metadata); under a budget below what it measures it is refused, the blocking check fails
    naming it, and nothing takes the serving alias (the served path: tests/test_serving.py)."""
    from mlflow.exceptions import MlflowException

    from assets.serving_models import serving_models
    from gem_ops.serving.registry import SERVING

    client, name = transferred["client"], "vertical_feed_click"
    config = {"latency_budget_ms": 1e-3, "latency_requests": 3, "latency_warmup": 1, "latency_candidates": [1, 100],
              "models": [name]}
    result = dg.materialize([serving_models], run_config={"ops": {"serving_models": {"config": config}}},
                            resources=transferred["resources"], instance=transferred["instance"],
                            partition_key=transferred["day"], selection=[serving_models], raise_on_error=False)
    figures = _materialization(result, "serving_models").metadata["models"].value[name]
    assert not figures["served"] and figures["version"] == str(current_version(client, name, CHAMPION))
    assert 1e-3 < figures["p50_ms.1"] and figures["p50_ms.100"] <= figures["p99_ms.100"]
    assert figures["requests_per_s.100"] > 0 and figures["artifact"].startswith("runs:/")
    assert "p50_ms.1000" not in figures  # only the configured candidate counts are measured
    check = _check(result)[0]
    assert not check.passed and check.metadata["refused"].value == [name]
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, SERVING)


def test_serving_latency_settings_come_from_the_run_config_and_the_gate_count_is_required():
    from assets.serving_models import ServingModelsConfig
    from gem_ops.serving.latency import LatencySettings

    assert ServingModelsConfig().latency_settings() == LatencySettings()
    config = ServingModelsConfig(latency_requests=7, latency_warmup=0, latency_candidates=[100, 10], latency_threads=2)
    assert config.latency_settings() == LatencySettings(candidate_counts=(100, 10), requests=7, warmup=0, threads=2)
    with pytest.raises(ValueError, match="latency_candidates .* include 100"):
        ServingModelsConfig(latency_candidates=[1, 1000]).latency_settings()
    with pytest.raises(ValueError, match="warmup=-1"):
        ServingModelsConfig(latency_warmup=-1).latency_settings()
    with pytest.raises(ValueError, match="candidate_counts must be positive"):
        ServingModelsConfig(latency_candidates=[0, 100]).latency_settings()


def test_shared_table_training_setting_maps_to_the_transfer_and_names_a_bad_value():
    from assets.student_training import StudentTrainingConfig

    assert StudentTrainingConfig().transfer().freeze_shared == "auto"
    assert StudentTrainingConfig(shared_table_training="fixed").transfer().freeze_shared is True
    assert StudentTrainingConfig(shared_table_training="trained").transfer().freeze_shared is False
    with pytest.raises(ValueError, match="shared_table_training"):
        StudentTrainingConfig(shared_table_training="frozen").transfer()
    assert StudentTrainingConfig().transfer().adapter_feature == ""
    assert StudentTrainingConfig(adapter_feature="item_category").transfer().adapter_feature == "item_category"
    assert StudentTrainingConfig(adapter_fit="held_out").transfer().adapter_fit == "held_out"
    assert StudentTrainingConfig(adapter_shift_only=True).transfer().adapter_shift_only is True
    with pytest.raises(ValueError, match="adapter_fit"):
        StudentTrainingConfig(adapter_fit="newest").transfer()


def test_every_transfer_setting_is_a_student_run_config_field():
    import dataclasses

    from assets.student_training import StudentTrainingConfig
    from gem_ops.transfer.config import TransferConfig

    named_apart = {"freeze_shared": "shared_table_training"}
    fields = {named_apart.get(f.name, f.name) for f in dataclasses.fields(TransferConfig)}
    assert fields - set(StudentTrainingConfig.model_fields) == set()
    config = StudentTrainingConfig(adapter_hidden=8, adapter_steps=50, adapter_lr=0.1, adapter_feature_buckets=16,
                                   adapter_shrinkage=True, distillation_head="auxiliary", representation=False,
                                   shared_tables=["item", "user_id"], student_adapter=False)
    assert config.transfer() == TransferConfig(
        distillation_head="auxiliary", student_adapter=False, adapter_hidden=8, adapter_steps=50, adapter_lr=0.1,
        adapter_feature_buckets=16, adapter_shrinkage=True, representation=False, shared_tables=("item", "user_id"))
    with pytest.raises(ValueError, match="adapter_steps"):
        StudentTrainingConfig(adapter_steps=0).transfer()


def test_verticals_weigh_the_teachers_targets_four_times_the_labels_and_domain_fms_once():
    from assets.domain_foundation_models import DomainFoundationModelsConfig
    from assets.vertical_models import VerticalModelsConfig

    assert VerticalModelsConfig().transfer().distillation_weight == 4.0
    assert DomainFoundationModelsConfig().transfer().distillation_weight == 1.0
    assert VerticalModelsConfig(distillation_weight=1.0).transfer().distillation_weight == 1.0
