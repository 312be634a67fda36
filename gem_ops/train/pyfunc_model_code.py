"""The GEM pyfunc as MLflow's models-from-code loads it: the package holds this file, not a pickled Python object,
so loading a registered model runs only the project's own code."""

import mlflow.models

from gem_ops.train.mlflow_model import GEMPyfunc

mlflow.models.set_model(GEMPyfunc())
