"""Adapters to other libraries, each in its own module and each importing its library only when
imported itself (``import flashhopper`` imports none of them):

- ``flashhopper.integrations.transformers``: a Hugging Face transformers attention backend.
"""
