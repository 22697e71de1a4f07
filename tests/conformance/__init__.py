"""Conformance tests: one behaviour, TorchRL's class and fastreplay's."""
