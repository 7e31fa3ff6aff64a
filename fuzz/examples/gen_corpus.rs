//! Writes the seed corpus (`fabric_fuzz::seeds`) to `corpus/<target>/<name>`, relative to
//! the current directory (run it in `fuzz/`: `cargo run --example gen_corpus`).

use std::path::Path;

fn main() -> std::io::Result<()> {
    for (target, name, bytes) in fabric_fuzz::seeds::all() {
        let dir = Path::new("corpus").join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), &bytes)?;
        println!("corpus/{target}/{name}: {} bytes", bytes.len());
    }
    Ok(())
}
