"""The one thing pyproject.toml cannot say: julia/ ships inside the wheel as the package harness._julia (the Flux
backend finds NanoGPTFlux there in an install, or at julia/ in a checkout). Every other package is discovered, so a
new subpackage cannot be forgotten; package data is listed in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["harness", "harness.*"]), "harness._julia"],
      package_dir={"harness._julia": "julia"})
