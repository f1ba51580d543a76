"""Tests of the Spark data source against a real daemon, in one local SparkSession per module."""
