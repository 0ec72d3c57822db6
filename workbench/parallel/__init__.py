"""Parallelism strategies, one file each, composed by `apply.parallelize` on one DeviceMesh.

This package imports torch only: no Ray, no widgets, no cloud SDKs.
"""
