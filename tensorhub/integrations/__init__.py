"""Integrations with the systems that start the processes TensorHub runs in.

Each lives in its own module and imports its system only when used:
:mod:`tensorhub.integrations.ray` needs ``pip install 'tensorhub[ray]'``.
"""
