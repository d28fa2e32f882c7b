//! The macros that define exported functions from the tables.

/// Defines CUDA driver functions, exported under their names (`#[unsafe(no_mangle)]`), with the
/// signatures of [`crate::cuda`]'s table. Each item is
///
/// ```text
/// /// docs
/// fn cuName(param, ...) { body }
/// fn cuName(param, ...) twin cuName_ptsz(per_thread) { body }
/// fn cuName_v2(param, ...) also cuName { body }
/// ```
///
/// The parameters are named as in the table's row, in its order (another name or count does not
/// compile); the body is the function's, returning the row's type. The second form defines both
/// the function and its per-thread-default-stream twin from one body, with `per_thread` (any name)
/// `false` in the first and `true` in the twin. The third defines functions that do the same
/// (versions of one call, `also` followed by one or more names) from one body, each with its own
/// row's signature and these parameter names.
///
/// The definitions are `pub unsafe extern "C" fn`: their callers are C programs, under the
/// header's contract for each function. A body must not unwind: run it in the crate's panic guard.
#[macro_export]
macro_rules! cuda_exports {
    ($($items:tt)*) => { $crate::__exports!(cuda; $($items)*); };
}

/// As [`cuda_exports!`], for NVML functions (the table of [`crate::nvml`]).
#[macro_export]
macro_rules! nvml_exports {
    ($($items:tt)*) => { $crate::__exports!(nvml; $($items)*); };
}

/// The exports macros' implementation: one item at a time.
#[doc(hidden)]
#[macro_export]
macro_rules! __exports {
    ($family:ident;) => {};
    ($family:ident;
        $(#[$m:meta])* fn $name:ident($($a:ident),* $(,)?) twin $twin:ident($pt:ident) $body:block
        $($rest:tt)*
    ) => {
        $crate::__exports!(@one $family; $(#[$m])* $name($($a),*) { let $pt = false; $body });
        $crate::__exports!(@one $family; $(#[$m])* $twin($($a),*) { let $pt = true; $body });
        $crate::__exports!($family; $($rest)*);
    };
    ($family:ident;
        $(#[$m:meta])* fn $name:ident($($a:ident),* $(,)?) also $also:ident, $($more:ident),+ $body:block
        $($rest:tt)*
    ) => {
        $crate::__exports!(@one $family; $(#[$m])* $name($($a),*) $body);
        $crate::__exports!($family; $(#[$m])* fn $also($($a),*) also $($more),+ $body $($rest)*);
    };
    ($family:ident;
        $(#[$m:meta])* fn $name:ident($($a:ident),* $(,)?) also $also:ident $body:block
        $($rest:tt)*
    ) => {
        $crate::__exports!(@one $family; $(#[$m])* $name($($a),*) $body);
        $crate::__exports!(@one $family; $(#[$m])* $also($($a),*) $body);
        $crate::__exports!($family; $($rest)*);
    };
    ($family:ident; $(#[$m:meta])* fn $name:ident($($a:ident),* $(,)?) $body:block $($rest:tt)*) => {
        $crate::__exports!(@one $family; $(#[$m])* $name($($a),*) $body);
        $crate::__exports!($family; $($rest)*);
    };
    (@one $family:ident; $(#[$m:meta])* $name:ident($($a:ident),*) $body:block) => {
        $(#[$m])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $crate::$family::params::$name::$a),*) -> $crate::$family::params::$name::Return
            $body
        // The definition has the row's signature: its parameter count and order too.
        const _: $crate::$family::pfn::$name = $name;
    };
}
