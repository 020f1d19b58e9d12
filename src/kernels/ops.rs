//! Element-wise ops (owned by the engine author).
