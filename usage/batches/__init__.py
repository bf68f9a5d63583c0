"""Batch jobs: the files, their validation, the runner and the API shapes.

``storage`` (where file bytes live), ``validation`` (an input file, line by
line), ``jobs`` (create, cancel, expire, finish a batch), ``runner`` (sends
lines to the gateway as the owner key, resumes after a crash), ``results``
(reading the output and error files back), ``shapes`` (the OpenAI and
Anthropic objects). The models are ``usage.models.batches``; the HTTP
surfaces are ``gateway.batches``; docs/batches.md describes it all.
"""
