"""The .ninfer v3 artifact: one file holding a model's tensors, resources, configs and provenance."""

from ninfer.artifact.reader import Artifact, Component, StoredTensor, open_artifact
from ninfer.artifact.writer import ArtifactWriter, WriteSummary

__all__ = ["Artifact", "ArtifactWriter", "Component", "StoredTensor", "WriteSummary", "open_artifact"]
