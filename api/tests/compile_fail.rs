//! What the memory API must refuse at compile time (docs/contract.md section 2): no safe code
//! gets a reference to registered memory that a peer, a NIC or a provider thread could
//! touch while the reference lives, typed (`as_mut_slice_of`, `as_slice_of`) or not, and a
//! vector taken over by `Buffer::from_vec` is gone from its old name. Each file in
//! `tests/ui` is a program that must not compile, with the compiler's error kept beside it.

#[test]
fn memory_access_model_is_enforced_by_the_compiler() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
