//! The macro that turns a family's table into types.

/// The return type of a row: its own (`-> T`) where it has one, else the family's.
macro_rules! row_return {
    ($family:ty;) => {
        $family
    };
    ($family:ty; $own:ty) => {
        $own
    };
}

/// Defines, from a table of rows `fn name(param: Type, ...) [-> Return] [, twin];`:
/// - `pfn::name`: the function's pointer type (`unsafe extern "C" fn(...) -> ...`), for tables of
///   a library's functions looked up by name;
/// - `params::name::param`: each parameter's type, and `params::name::Return`, which the exports
///   macros build definitions from;
/// - `NAMES`: every name, twins included.
macro_rules! table {
    ($ret:ty; $( fn $name:ident($($p:ident: $t:ty),* $(,)?) $(-> $own:ty)? $(, $twin:ident)?; )*) => {
        /// Each function's pointer type, by name.
        #[allow(non_camel_case_types)]
        pub mod pfn {
            use super::*;
            $(
                pub type $name = unsafe extern "C" fn($($t),*) -> row_return!($ret; $($own)?);
                $(pub type $twin = $name;)?
            )*
        }

        /// Each function's parameter types (and `Return`), by function and parameter name.
        #[allow(non_camel_case_types, non_snake_case)]
        pub mod params {
            $(
                pub mod $name {
                    use super::super::*;
                    $(pub type $p = $t;)*
                    pub type Return = row_return!($ret; $($own)?);
                }
                $(pub mod $twin {
                    pub use super::$name::*;
                })?
            )*
        }

        /// Every function in the table, twins included.
        pub const NAMES: &[&str] = &[$(stringify!($name), $(stringify!($twin),)?)*];
    };
}
