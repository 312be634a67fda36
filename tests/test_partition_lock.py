"""Two materializations of one partition at once: the second fails at once, naming the run that holds the
partition, and leaves its files alone; once the first is done the partition materializes again."""

import fcntl

import dagster as dg

from assets.raw_event_logs import raw_event_logs
from assets.resources import LakeResource, MLflowResource

DAY = "2026-11-03"
CONFIG = {"ops": {"raw_event_logs": {"config": {"synthetic_users": 100}}}}


def test_a_partition_being_materialized_is_refused_to_a_second_run(tmp_path):
    resources = {"lake": LakeResource(base_dir=str(tmp_path / "lake")),
                 "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                          artifact_location=str(tmp_path / "artifacts"))}
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        first = dg.materialize([raw_event_logs], partition_key=DAY, resources=resources, instance=instance,
                               run_config=CONFIG)
        written = (tmp_path / "lake" / "raw_event_logs" / f"{DAY}.parquet").read_bytes()
        lock_file = tmp_path / "lake" / ".locks" / "raw_event_logs" / f"{DAY}.lock"
        with open(lock_file, "a+") as held:  # what a run materializing the partition holds
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.truncate(0)
            held.write("Dagster run 1234-holder, pid 1, since now")
            held.flush()
            second = dg.materialize([raw_event_logs], partition_key=DAY, resources=resources, instance=instance,
                                    run_config=CONFIG, raise_on_error=False)
        failure = next(e for e in second.all_events if e.event_type_value == "STEP_FAILURE").event_specific_data.error
        assert not second.success
        assert (f"raw_event_logs [{DAY}] is being materialized by another run (Dagster run 1234-holder"
                in failure.message)
        assert (tmp_path / "lake" / "raw_event_logs" / f"{DAY}.parquet").read_bytes() == written
        third = dg.materialize([raw_event_logs], partition_key=DAY, resources=resources, instance=instance,
                               run_config=CONFIG)
        assert first.success and third.success and third.run_id in lock_file.read_text()
