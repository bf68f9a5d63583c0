"""The configuration history: every change recorded as a version, and reverts.

``recording`` writes the versions, ``diff`` compares two of them, ``revert``
restores one through the import.
"""
