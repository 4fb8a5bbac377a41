"""spotagent: run deep-learning training on EC2 Spot from a pool of warm EBS volumes."""

__version__ = "0.1.0"
