"""The pipeline's assets. Two Dagster features they use on purpose are marked beta / preview (look-back
partition mappings that allow days before the first, partitioned asset checks); their warnings would repeat
in every run log, so they are silenced here, once, for these two categories only."""

import warnings

import dagster as dg

warnings.filterwarnings("ignore", category=dg.BetaWarning)
warnings.filterwarnings("ignore", category=dg.PreviewWarning)
