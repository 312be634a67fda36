"""The GEM model: TorchRec embeddings, a Wukong interaction arm, a pyramid sequence arm, InterFormer
interleaving and per-domain per-task heads. GEM, domain FMs and vertical models are sizes of this code."""
