//! Placeholder; see the module's issue.
