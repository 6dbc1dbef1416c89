//! Tests of the prefix indexes: table-style cases, a model-based test, the approximate
//! index, and the slot table.

mod approx;
mod cases;
mod model;
mod table;
