"""GEM training library: data, model, training, transfer and metrics. Never imports dagster."""
