"""torchturbo doctor: the article's closing checklist as a live diagnosis of a model and loader.

``diagnose(recipe)`` inspects the model and data, profiles a few training steps through the
engine, times quick variants (bf16, channels_last, Conv→BN folding) side by side, and judges the
15 items (5 groups x 3) with a state, the evidence, and a measured gain where there is one.
``render`` prints the result; ``Diagnosis.to_dict`` gives JSON. See docs/doctor.md.
"""

from torchturbo.doctor.core import diagnose
from torchturbo.doctor.diagnosis import CHECKLIST, STATES, Diagnosis, Item
from torchturbo.doctor.render import render

__all__ = ["CHECKLIST", "STATES", "Diagnosis", "Item", "diagnose", "render"]
