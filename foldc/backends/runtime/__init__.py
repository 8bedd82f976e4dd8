"""What both attention backends share at run time and build time, written once: module loading and
the interpreter switch (modules), the merge kernel (merge), the tuning cache and its config types
(tuning), the fast launch path (fast_launch), and the AOT artifacts and SASS reading (artifacts,
sass). Neither backend imports the other; both import this package.
"""
