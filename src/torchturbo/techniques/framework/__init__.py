"""What a technique declares and what its hooks read and return (the registry's vocabulary).

- ``spec.py``: :class:`Technique`, the declaration every technique module makes once;
- ``result.py``: what applying a technique did;
- ``proposal.py``: the tuner's candidates and the context its stages read;
- ``levers.py``: the expected gains that order the tuner's work and the doctor's ranking;
- ``facts.py``: the facts about a recipe on this machine those expectations are made from.

It imports no technique: the technique modules and the registry sit above it.
"""
