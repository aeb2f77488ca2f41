"""Exporting a trained policy: ONNX, TorchScript and a one-file archive (``formats``)."""

from ppokit.export.formats import FORMATS, DeployedPolicy, ExportError, deployed_policy, export, model_card

__all__ = ["FORMATS", "DeployedPolicy", "ExportError", "deployed_policy", "export", "model_card"]
