"""The shipped YAML configurations, installed as the package `prefixcache.configs`.

This directory stays at the top of the source tree, where the README's commands name its
files (`configs/ab.yaml`); setup.py maps it to `prefixcache.configs` and ships `*.yaml` as
package data, so an installed `prefixcache ab` finds its default through
importlib.resources. Must never: hold code.
"""
